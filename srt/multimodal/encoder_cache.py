"""The encoder cache: each image's vision features (projected, ready to splice into the
language model's embeddings) by content hash, least recently used first out, bounded in bytes
(--mm-cache-size-gb). An image whose KV the radix cache evicted, or that appears after other
text, is encoded once while its features stay here.

It counts lookups that hit and missed, images encoded and tower forwards (several images of
one size run in one), for /get_server_info and /metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.hits = self.misses = self.encoded_images = self.encoder_runs = 0

    def get(self, key: str) -> Any | None:
        """The features of `key`, counted as a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: str, features: Any, nbytes: int) -> None:
        """Keeps `features`, evicting the least recently used; one larger than the whole cache is
        not kept."""
        if key in self._entries or nbytes > self.capacity_bytes:
            return
        while self.used_bytes + nbytes > self.capacity_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.used_bytes -= freed
        self._entries[key] = (features, nbytes)
        self.used_bytes += nbytes

    def ran(self, images: int) -> None:
        """A tower forward encoded `images` images."""
        self.encoder_runs += 1
        self.encoded_images += images

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "encoded_images": self.encoded_images,
                "encoder_runs": self.encoder_runs, "entries": len(self._entries), "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes}
