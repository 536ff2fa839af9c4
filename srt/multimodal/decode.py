"""An image as a client sends it -> a decoded RGB Pillow image, checked against the limits.

Accepted: raw bytes, a base64 string, a data URL (`data:image/png;base64,...`), a PIL image; a
local path (or file:// URL) only where the limits allow paths (the in-process Engine), an
http(s) URL only with --allow-remote-images. Runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from typing import Any

from PIL import Image, UnidentifiedImageError

from .limits import ImageLimits

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
REMOTE_TIMEOUT_S = 10.0
MAX_REMOTE_BYTES = 32 * 2**20
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)
_PATH_LIKE = re.compile(r"[~./\\]")
_WHITESPACE = re.compile(r"\s+")


def load_image(item: Any, field: str, limits: ImageLimits) -> Image.Image:
    """The image `item` holds, decoded to RGB; ValueError naming `field` for anything refused."""
    if isinstance(item, Image.Image):
        limits.check_pixels(item.size, field)
        return item if item.mode == "RGB" else item.convert("RGB")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return decode_bytes(bytes(item), field, limits)
    if not isinstance(item, str):
        raise ValueError(f"{field}: expected a base64 string, a data URL or image bytes, got {type(item).__name__}")
    if item.startswith("data:"):
        return decode_bytes(_data_url_bytes(item, field), field, limits)
    if item.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise ValueError(f"{field}: remote image URLs are not fetched by this server (start it with "
                             "--allow-remote-images); send the image as a data URL or base64")
        return decode_bytes(_fetch(item, field), field, limits)
    # Over HTTP the file system is never looked at; the Engine's caller may name its own files.
    if item.startswith("file://") or (limits.allow_paths and os.path.isfile(os.path.expanduser(item))):
        return decode_bytes(_read_file(item.removeprefix("file://"), field, limits), field, limits)
    try:
        data = _base64(item, f"{field}: not valid base64")
    except ValueError:
        if _PATH_LIKE.search(item):  # not base64, and it reads like a path: say why it is refused
            _read_file(item, field, limits)
        raise
    return decode_bytes(data, field, limits)


def decode_bytes(data: bytes, field: str, limits: ImageLimits) -> Image.Image:
    if not data:
        raise ValueError(f"{field}: the image is empty")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only: the size is checked before decoding
    except UnidentifiedImageError:
        raise ValueError(f"{field}: cannot decode the image (not an image, or an unknown format)") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"{field}: too many pixels ({e})") from None
    if image.format not in ACCEPTED_FORMATS:
        raise ValueError(f"{field}: unsupported image format {image.format!r} (accepted: {', '.join(ACCEPTED_FORMATS)})")
    limits.check_pixels(image.size, field)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ValueError(f"{field}: cannot decode the {image.format} image: {e}") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def _data_url_bytes(url: str, field: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise ValueError(f"{field}: a malformed data URL (expected data:image/...;base64,...)")
    media_type, params, payload = match.groups()
    if not media_type.startswith("image/"):
        raise ValueError(f"{field}: unsupported format: the data URL's media type is {media_type or 'empty'!r}, "
                         "not image/*")
    if ";base64" not in params:
        raise ValueError(f"{field}: the data URL must be base64-encoded (data:{media_type};base64,...)")
    return _base64(payload, f"{field}: the data URL's payload is not valid base64")


def _base64(text: str, error: str) -> bytes:
    try:
        return base64.b64decode(_WHITESPACE.sub("", text), validate=True)  # MIME line breaks are fine
    except (binascii.Error, ValueError):
        raise ValueError(error) from None


def _read_file(path: str, field: str, limits: ImageLimits) -> bytes:
    if not limits.allow_paths:
        raise ValueError(f"{field}: local file paths are not accepted over HTTP; send the image as a data URL or "
                         "base64")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"{field}: no image file at {path!r}")
    with open(path, "rb") as f:
        return f.read()


def _fetch(url: str, field: str) -> bytes:
    """The body of `url`, at most MAX_REMOTE_BYTES, within REMOTE_TIMEOUT_S per read."""
    import httpx

    try:
        with httpx.stream("GET", url, timeout=REMOTE_TIMEOUT_S, follow_redirects=True, trust_env=False) as response:
            if response.status_code != 200:
                raise ValueError(f"{field}: fetching {url} answered HTTP {response.status_code}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_REMOTE_BYTES:
                    raise ValueError(f"{field}: the image at {url} is larger than {MAX_REMOTE_BYTES} bytes")
            return bytes(body)
    except httpx.HTTPError as e:
        raise ValueError(f"{field}: cannot fetch {url}: {type(e).__name__}: {e}") from None
