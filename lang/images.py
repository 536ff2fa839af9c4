"""Images in programs: `sgl.image(x)` turns a path, bytes, a PIL image or a data URL into the
data URL the server's `image_data` takes. Torch- and Pillow-free unless given a PIL image."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

# Leading bytes -> the format's MIME type, for the data URL (the server decodes by content).
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"BM", "image/bmp"))


def image_data_url(x: Any) -> str:
    """`x` as a `data:image/...;base64,` URL. x: a data URL (kept), a local path (str or Path),
    bytes, or a PIL image (saved as PNG)."""
    if isinstance(x, str) and x.startswith("data:"):
        return x
    if isinstance(x, (str, Path)):
        path = Path(x).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"image: no such file: {x}")
        return _from_bytes(path.read_bytes())
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(x))
    if hasattr(x, "save") and hasattr(x, "mode"):  # a PIL image, without importing Pillow here
        import io

        buffer = io.BytesIO()
        x.save(buffer, format="PNG")
        return _from_bytes(buffer.getvalue())
    raise TypeError(f"image: takes a path, bytes, a PIL image or a data URL, not {type(x).__name__}")


def _from_bytes(data: bytes) -> str:
    if not data:
        raise ValueError("image: the image is empty")
    mime = next((m for magic, m in _MAGIC if data.startswith(magic)), None)
    if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    return f"data:{mime or 'application/octet-stream'};base64,{base64.b64encode(data).decode()}"
