"""Incremental detokenization of one request's output: token-id deltas in, text deltas out.

Invariant: the concatenation of everything `feed` and `finish` return equals
`tokenizer.decode(all_ids, skip_special_tokens=..., spaces_between_special_tokens=...)`, cut
before the first occurrence of the stop string (or stop regex match) that ended the request
(unless `no_stop_trim`). A streamed client never sees a partial character nor any piece of a
stop string or stop regex match that will be trimmed.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import regex

logger = logging.getLogger(__name__)

# What a UTF-8 decode with errors="replace" yields for a byte sequence cut short at the end.
REPLACEMENT_CHAR = "\ufffd"
# Emitted text kept as context for stop regexes, so a lookbehind, \b or ^ at the start of the
# held text sees what precedes it (the held text itself is searched in full).
_REGEX_CONTEXT_CHARS = 256
# The scheduler's budget for one stop-regex search (scheduler/finish.py): a pattern may backtrack
# exponentially and this process serves every request.
_STOP_REGEX_TIMEOUT_S = 0.05


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
        stop_regex: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, bool] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._stop = [s for s in stop if s]
        self._stop_regex = [regex.compile(p) for p in stop_regex]
        self._no_stop_trim = no_stop_trim
        # Window of output ids: _ids[:_read_len] is context already emitted, decoded as _head_text.
        self._ids: list[int] = []
        self._read_len = 0
        self._head_text = ""
        # Chars of the window's new text already emitted early (those before a trailing U+FFFD).
        self._emitted_len = 0
        # Complete text withheld because it may be (the start of) a stop string or regex match.
        self._held = ""
        self._regex_context = ""  # the emitted text's tail, see _REGEX_CONTEXT_CHARS
        self._regex_timed_out = False
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
            # Emitted text never holds (part of) a request stop string or a possible start of a
            # stop regex match, so the first occurrence in the whole output is the first one here.
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
        """Passes text on, except a tail that is or may become a stop string or regex match to be
        trimmed."""
        if self._no_stop_trim or not (self._stop or self._stop_regex):
            return text
        held = self._held + text
        keep_from = min(self._stop_string_start(held), self._stop_regex_start(held))
        self._held = held[keep_from:]
        released = held[:keep_from]
        if self._stop_regex:
            self._regex_context = (self._regex_context + released)[-_REGEX_CONTEXT_CHARS:]
        return released

    def _stop_string_start(self, held: str) -> int:
        """Where in `held` the first stop string, or a tail that may still complete one, starts."""
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
        return keep_from

    def _stop_regex_start(self, held: str) -> int:
        """Where in `held` the earliest stop regex match starts, counting a partial match (one
        that reaches the end, so more text may complete it): a match is known, and trimmed,
        only once complete, and streamed text can't be taken back."""
        if not self._stop_regex:
            return len(held)
        if self._regex_timed_out:
            return 0  # unknowable: hold everything back; finish() still trims it right
        text, pos = self._regex_context + held, len(self._regex_context)
        keep_from = len(text)
        try:
            for pattern in self._stop_regex:
                found = pattern.search(text, pos, partial=True, timeout=_STOP_REGEX_TIMEOUT_S)
                while found is not None:
                    if found.partial or found.end() > found.start():  # a complete empty match trims nothing
                        keep_from = min(keep_from, found.start())
                    if found.partial or found.start() == pos:
                        break
                    # `regex` prefers a full match to a partial one that starts earlier: look
                    # before it (in the text cut there, which may hold back a little too much).
                    earlier = pattern.search(text, pos, found.start(), partial=True, timeout=_STOP_REGEX_TIMEOUT_S)
                    found = earlier if earlier is not None and earlier.start() < found.start() else None
        except TimeoutError:
            self._regex_timed_out = True
            return 0
        return keep_from - pos
