"""/generate's SSE events as SGLang sends them by default: each event holds the text, ids and
logprobs so far (clients take `text[len(previous):]`), built from chunks that hold only what is
new. Each chunk's new part is serialized once and appended to the JSON kept so far, so an
event costs a copy of bytes, not a serialization of everything so far."""

from __future__ import annotations

from typing import Any

import orjson

from ..results import LOGPROB_FIELDS


class _JsonList:
    """A JSON list's items, serialized as they are appended (its text without the brackets)."""

    def __init__(self) -> None:
        self.items = bytearray()

    def extend(self, items: list[Any]) -> None:
        if items:
            if self.items:
                self.items += b","
            self.items += orjson.dumps(items)[1:-1]


class CumulativeStream:
    """One sample's events: `event(chunk)` for each of its chunks, in order. `index` goes into
    each event when the request has several samples."""

    def __init__(self, index: int | None = None):
        self._suffix = b"}\n\n" if index is None else b',"index":%d}\n\n' % index
        self._text = bytearray()  # the JSON string's characters: escaping is per character
        self._ids = _JsonList()
        self._logprobs: dict[str, _JsonList] = {}

    def event(self, chunk: dict[str, Any]) -> bytes:
        self._text += orjson.dumps(chunk["text"])[1:-1]
        self._ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
        counters = orjson.dumps({k: v for k, v in meta.items() if k not in LOGPROB_FIELDS})
        parts = [b'data: {"text":"', self._text, b'","output_ids":[', self._ids.items, b'],"meta_info":',
                 counters[:-1]]
        sep = b"," if len(counters) > 2 else b""
        for name in LOGPROB_FIELDS:  # after the counters, as in results.result()
            if name in meta:
                items = self._logprobs.setdefault(name, _JsonList())
                items.extend(meta[name])
                parts += [sep, b'"', name.encode(), b'":[', items.items, b"]"]
                sep = b","
        parts += [b"}", self._suffix]
        return b"".join(parts)
