"""The client side's tokenizer: token ids and chat-template rendering exactly as the server's.

`select` needs token ids to find where the prompt ends and a choice begins, and roles need the
model's chat template. Both come from the model's own tokenizer files, loaded here with the
`tokenizers` library and rendered with transformers' own Jinja renderer — neither imports
torch, so a client starts in a second or two. The server tokenizes with
`tokenizer.encode(text, add_special_tokens=False)` and renders chats with
`apply_chat_template(..., tokenize=False)`; these produce the same ids and text.

Where the files are not on disk in HF form (a GGUF never converted, a hub id), the runtime's
own loader (`radixlm.srt.executor.model_loader`, which imports torch) is used once to produce them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_MARKER_FILE = "radixlm_source.json"  # written by srt/gguf_loader.py into each converted directory


class ClientTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str: ...


class DirTokenizer:
    """A tokenizer from an HF-format directory (tokenizer.json plus config / chat template)."""

    def __init__(self, directory: str | os.PathLike[str]):
        from tokenizers import Tokenizer

        path = Path(directory)
        self.path = str(path)
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        self.chat_template = _chat_template(path, config)
        self.special_tokens = {k: v for k in _SPECIAL_TOKEN_NAMES if (v := _token_text(config.get(k))) is not None}

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.path} has no chat template")
        return render_chat_template(self.chat_template, self.special_tokens, messages, add_generation_prompt)


def render_chat_template(template: str, special_tokens: dict[str, str], messages: list[dict[str, Any]],
                         add_generation_prompt: bool) -> str:
    """Renders a Jinja chat template as transformers' apply_chat_template does (same helpers,
    same special-token variables), without loading a tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **special_tokens)
    return rendered[0]


class HFTokenizer:
    """Wraps a transformers tokenizer object (the fallback path, or one a user passes in)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # HF tokenizers may mutate padding state while encoding

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        with self._lock:
            return self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False)


_cache: dict[tuple[str, str | None], ClientTokenizer] = {}
_cache_lock = threading.Lock()


def load_client_tokenizer(model_path: str | None, tokenizer_path: str | None = None) -> ClientTokenizer:
    """The tokenizer for a model as the server names it (`model_path` None: the default model).

    Raises FileNotFoundError / ValueError when it cannot be found. Results are cached per path.
    """
    key = (str(model_path), tokenizer_path)
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = _load(model_path, tokenizer_path)
        return found


def _load(model_path: str | None, tokenizer_path: str | None) -> ClientTokenizer:
    for source in (tokenizer_path, model_path):
        if source is None:
            continue
        directory = _hf_dir_without_torch(Path(source).expanduser())
        if directory is not None:
            logger.debug("client tokenizer from %s", directory)
            return DirTokenizer(directory)
    # Convert or download through the runtime's loader; it caches what it produces.
    from radixlm.srt.executor.model_loader import load_model

    meta = load_model(model_path, tokenizer_path=tokenizer_path, with_weights=False)
    if meta.tokenizer is None:
        raise ValueError(f"{model_path}: the model has no tokenizer; pass tokenizer_path")
    local = Path(tokenizer_path or meta.local_dir)
    directory = _hf_dir_without_torch(local)
    return DirTokenizer(directory) if directory is not None else HFTokenizer(meta.tokenizer)


def _hf_dir_without_torch(path: Path) -> Path | None:
    """An HF tokenizer directory for `path` if one already exists on disk, else None."""
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf_dir(path)
    return None


def _converted_gguf_dir(gguf_path: Path) -> Path | None:
    """The directory srt/gguf_loader.py converted this GGUF into, found by its marker file."""
    root_env = os.environ.get("RADIXLM_CACHE_DIR")
    root = Path(root_env).expanduser() if root_env else Path.home() / ".cache" / "radixlm" / "converted"
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    if not root.is_dir():
        return None
    for candidate in sorted(root.glob(f"{resolved.stem}-*")):
        marker = _read_json(candidate / _MARKER_FILE)
        same_file = (marker.get("source") == str(resolved) and marker.get("size") == stat.st_size
                     and marker.get("mtime_ns") == stat.st_mtime_ns)
        if same_file and (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
