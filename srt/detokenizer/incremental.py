"""Incremental detokenization of one request's output: token-id deltas in, text deltas out.

Invariant: the concatenation of everything `feed` and `finish` return equals
`tokenizer.decode(all_ids, skip_special_tokens=..., spaces_between_special_tokens=...)`, cut
before the first occurrence of the stop string that ended the request (unless `no_stop_trim`).
A streamed client never sees a partial character nor any piece of a stop string that will be
trimmed.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# What a UTF-8 decode with errors="replace" yields for a byte sequence cut short at the end.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's decoding state; create it on the request's first output, drop it at finish.

    Text is decoded from a small window `ids[prefix:]` of the output ids and compared with the
    decode of its already-emitted head `ids[prefix:read]`: the difference is the new text. Keeping
    a little context before `read` makes tokenizers whose decode adds or strips a space at the
    start (SentencePiece-style) give the same text as one decode of the whole output, and the
    window keeps each step O(window) instead of O(output length). The window slides only at a
    clean character boundary (decoded text not ending in U+FFFD), so a multi-byte character split
    over byte tokens is emitted once, when complete.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, bool] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._stop = [s for s in stop if s]
        self._no_stop_trim = no_stop_trim
        # Window of output ids: _ids[:_read_len] is context already emitted, decoded as _head_text.
        self._ids: list[int] = []
        self._read_len = 0
        self._head_text = ""
        # Chars of the window's new text already emitted early (those before a trailing U+FFFD).
        self._emitted_len = 0
        # Complete text withheld because it may be (the start of) a stop string.
        self._held = ""
        self.finished = False

    def feed(self, new_ids: Sequence[int]) -> str:
        """Adds output ids; returns the text that became final and safe to show."""
        if self.finished:
            raise RuntimeError("feed after finish")
        return self._release(self._decode_step(new_ids, final=False))

    def finish(self, finish_reason: dict[str, Any] | None) -> str:
        """Returns all remaining text, trimmed at the stop string that ended the request."""
        if self.finished:
            raise RuntimeError("finish called twice")
        self.finished = True
        text = self._held + self._decode_step((), final=True)
        self._held = ""
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str) and matched and not self._no_stop_trim:
            # Emitted text never holds (part of) a request stop string, so the first occurrence
            # in the whole output is the first one here. A stop regex's match can't be held back;
            # if it was already streamed there is nothing left to cut.
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
            else:
                logger.debug("stop string %r not found in the unsent text", matched)
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        try:
            return self._tokenizer.decode(ids, **self._decode_kwargs)
        except TypeError:
            # Some tokenizers reject spaces_between_special_tokens; it only matters to slow ones.
            if self._decode_kwargs.pop("spaces_between_special_tokens", None) is None:
                raise
            return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_step(self, new_ids: Sequence[int], final: bool) -> str:
        """Text newly made stable by `new_ids` (at `final`, all the rest, U+FFFD included)."""
        self._ids.extend(new_ids)
        if len(self._ids) == self._read_len:
            return ""
        text = self._decode(self._ids)
        # Tokenizers decode the context the same way in both calls, so its text is a prefix here.
        new_text = text[len(self._head_text):]
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            # An incomplete character at the end: emit what precedes it, keep the window.
            stable = new_text.rstrip(REPLACEMENT_CHAR)
            delta = stable[self._emitted_len:]
            self._emitted_len = max(self._emitted_len, len(stable))
            return delta
        delta = new_text[self._emitted_len:]
        # Clean boundary: the ids just decoded become the next window's context.
        self._ids = self._ids[self._read_len:]
        self._read_len = len(self._ids)
        self._head_text = self._decode(self._ids)
        self._emitted_len = 0
        return delta

    def _release(self, text: str) -> str:
        """Passes text on, except a tail that is or may become a stop string to be trimmed."""
        if not self._stop or self._no_stop_trim:
            return text
        held = self._held + text
        keep_from = len(held)
        for stop in self._stop:
            found = held.find(stop)
            if found >= 0:
                keep_from = min(keep_from, found)
            # The longest tail of `held` that is a proper prefix of `stop` (it may still complete).
            for size in range(min(len(stop) - 1, len(held)), 0, -1):
                if held.endswith(stop[:size]):
                    keep_from = min(keep_from, len(held) - size)
                    break
        self._held = held[keep_from:]
        return held[:keep_from]
