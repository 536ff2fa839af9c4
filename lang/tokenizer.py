"""Local tokenizers the caller names, and chat-template rendering without a tokenizer.

A radixlm (or SGLang) server is asked for token ids (/tokenize) and reports its chat template
and special tokens (/get_model_info), so RuntimeEndpoint needs no model files: it renders roles
with `render_chat_template`. A local tokenizer is used only where the caller passes a
`tokenizer_path` (the OpenAI backend's chat template; a RuntimeEndpoint told to tokenize on
this machine).

Ids and text match the server's: it tokenizes with `tokenizer.encode(text,
add_special_tokens=False)` and renders chats with `apply_chat_template(..., tokenize=False)`.
An HF tokenizer directory is read with the `tokenizers` library and rendered with
transformers' own Jinja renderer; neither imports torch.
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
                         add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None) -> str:
    """Renders a Jinja chat template as transformers' apply_chat_template does (same helpers,
    same special-token variables, the same `tools` argument), without loading a tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **special_tokens)
    return rendered[0]


class HFTokenizer:
    """Wraps a transformers tokenizer object (a hub id or a GGUF file, or one a user passes in)."""

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


_cache: dict[str, ClientTokenizer] = {}
_cache_lock = threading.Lock()


def load_client_tokenizer(tokenizer_path: str | os.PathLike[str]) -> ClientTokenizer:
    """The tokenizer at `tokenizer_path`: an HF tokenizer directory, a GGUF file, or a hub id.

    Raises OSError / ValueError when it cannot be loaded. Results are cached per path.
    """
    key = os.fspath(tokenizer_path)
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = _load(Path(key).expanduser())
        return found


def _load(path: Path) -> ClientTokenizer:
    if path.is_dir() and (path / "tokenizer.json").is_file():
        logger.debug("client tokenizer from %s", path)
        return DirTokenizer(path)
    # Anything else goes through transformers (slow tokenizers, GGUF vocabularies, hub ids).
    from transformers import AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))


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
