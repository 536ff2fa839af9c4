"""The detokenizer's `decode`: from the tokenizer's own tokenizer.json through the `tokenizers`
library when that gives exactly what transformers' tokenizer would, else transformers' tokenizer.

Why: transformers imports torch, and in a fresh process loading a tokenizer through it costs ~6 s
of CPU (~0.3 s through `tokenizers`). The detokenizer starts beside the scheduler and the server
process, so on a 2-core machine that time came out of the server's start (docs/performance.md).

A fast tokenizer's `decode` in transformers is the Rust tokenizer's `decode`, then the
"clean up tokenization spaces" rewrite when the tokenizer asks for it (and transformers' version
applies it). The Rust tokenizer is the one in tokenizer.json, with the special tokens that
tokenizer_config.json names registered as special, and a model-specific tokenizer class may
rebuild parts of it. So `tokenizers` alone is used only when none of that changes anything: a
generic tokenizer class, no clean-up, and every special token that tokenizer_config.json names
already marked special in tokenizer.json (as in every tokenizer transformers converts from a
GGUF, the embedded default model's included).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class RustDecoder:
    """`decode(ids, skip_special_tokens=...)` as transformers' fast tokenizer gives it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_slow_only: Any) -> str:
        # spaces_between_special_tokens matters to slow tokenizers only; fast ones ignore it.
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(tokenizer_dir: str) -> Any:
    """A decoder for the detokenizer: RustDecoder when exact (see the module docstring), else
    transformers' tokenizer."""
    decoder = rust_decoder(tokenizer_dir)
    if decoder is not None:
        return decoder
    from ..executor.model_loader import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def rust_decoder(tokenizer_dir: str) -> RustDecoder | None:
    """RustDecoder for a tokenizer directory when it decodes exactly as transformers would, else
    None (the reason is logged)."""
    directory = Path(tokenizer_dir)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    reason = _why_not_exact(config, json.loads(tokenizer_file.read_text()).get("added_tokens", []))
    if reason is not None:
        logger.info("decoding through transformers: %s", reason)
        return None
    from tokenizers import Tokenizer

    return RustDecoder(Tokenizer.from_file(str(tokenizer_file)))


def _why_not_exact(config: dict, added_tokens: list[dict]) -> str | None:
    tokenizer_class = config.get("tokenizer_class")  # unset: transformers picks the model type's
    if tokenizer_class not in GENERIC_CLASSES:
        return f"tokenizer class {tokenizer_class or 'chosen by the model type'}"
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    special = {token["content"] for token in added_tokens if token.get("special")}
    by_id = {str(token["id"]): token for token in added_tokens}
    for token_id, token in config.get("added_tokens_decoder", {}).items():
        ours = by_id.get(token_id)
        if ours is None or ours["content"] != token.get("content") or bool(ours.get("special")) != bool(token.get("special")):
            return f"added token {token_id} differs between tokenizer_config.json and tokenizer.json"
    for name in _named_special_tokens(config):
        if name not in special:
            return f"special token {name!r} is not marked special in tokenizer.json"
    return None


def _named_special_tokens(config: dict) -> list[str]:
    values = [config.get(key) for key in _NAMED_SPECIAL_TOKENS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        more = config.get(key) or []
        values += list(more.values()) if isinstance(more, dict) else list(more)
    names = []
    for value in values:
        content = value.get("content") if isinstance(value, dict) else value
        if content:
            names.append(content)
    return names
