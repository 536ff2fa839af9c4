"""An image's identity for both caches: a content hash, and the pseudo token ids its
placeholders carry in the radix cache.

The hash covers the decoded RGB pixels, their size and the processor's settings, so the same
picture sent as PNG or JPEG-identical bytes hits, and any change to what the tower would see
misses. Pseudo ids lie in [vocab_size, 2**31): no text token has one, so an image's KV is never
shared with text, and two images share KV only if their hashes' id streams agree token for
token (2**-31 per token).
"""

from __future__ import annotations

import hashlib

import numpy as np

PSEUDO_ID_LIMIT = 2**31  # ids stay int32-safe wherever a token id goes


def image_hash(rgb_bytes: bytes, size: tuple[int, int], settings: str) -> str:
    """sha256 hex of the pixels, their width and height, and the processor settings."""
    h = hashlib.sha256()
    h.update(f"{size[0]}x{size[1]}:".encode())
    h.update(rgb_bytes)
    h.update(settings.encode())
    return h.hexdigest()


def pseudo_ids(content_hash: str, count: int, vocab_size: int) -> list[int]:
    """The ids of an image's `count` placeholder tokens: token i's id is drawn from the hash's
    SHAKE-256 stream at index i."""
    stream = np.frombuffer(hashlib.shake_256(bytes.fromhex(content_hash)).digest(4 * count), dtype="<u4")
    return (vocab_size + stream.astype(np.int64) % (PSEUDO_ID_LIMIT - vocab_size)).tolist()
