"""Checks on a prompt shared by the Engine and the server: one ValueError naming the field."""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any, text: Any, input_ids: Any, vocab_size: int, context_len: int,
                     text_field: str = "text", ids_field: str = "input_ids") -> list[int]:
    """Token ids for exactly one of `text` / `input_ids`, checked against vocab and context."""
    if (text is None) == (input_ids is None):
        raise ValueError(f"{text_field}: give exactly one of {text_field} or {ids_field}")
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"{text_field}: must be a string")
        if not text:
            raise ValueError(f"{text_field}: must not be empty")
        ids, field = tokenizer.encode(text, add_special_tokens=False), text_field
    else:
        ids, field = input_ids, ids_field
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{field}: must be a list of token ids")
    if not ids:
        raise ValueError(f"{field}: must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token ids {bad[:3]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"{field}: {len(ids)} tokens do not fit the context length {context_len}")
    return ids
