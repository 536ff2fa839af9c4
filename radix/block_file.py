"""One disk-tier block file: its bytes, and reading one back verified.

    header  HEADER: magic, format version, header length, sha256(identity), payload length
    payload exactly the block's bytes
    trailer blake2b-128 of header + payload

A file of another identity or format version is not ours to judge (a replica may use it); a
short, long, garbled or wrongly sized file of ours is bad. Pure Python, like the rest of radix/.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

MAGIC = b"RLKV"
FORMAT_VERSION = 1
# magic, version, header length, sha256(identity), payload length
HEADER = struct.Struct("<4sHH32sQ")
CHECKSUM_BYTES = 16


def checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    h.update(header)
    h.update(payload)
    return h.digest()


def block_chunks(identity_hash: bytes, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """A block file's contents for `payload`, in the order they are written."""
    header = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, identity_hash, len(payload))
    return [header, payload, checksum(header, payload)]


def read_block(path: Path, identity_hash: bytes, out: memoryview) -> tuple[bool, bool, os.stat_result | None]:
    """Reads the payload of the block file at `path` into `out` (its expected size) and
    verifies it there: (whether `out` holds it, whether the file is bad, its stat)."""
    length = len(out)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            header = f.read(HEADER.size)
            if len(header) < HEADER.size:
                return False, True, st
            magic, version, header_len, stored_identity, stored_length = HEADER.unpack(header)
            if magic != MAGIC:
                return False, True, st
            if version != FORMAT_VERSION or stored_identity != identity_hash:
                return False, False, st  # another format or model: maybe valid for its writer
            if header_len != HEADER.size or stored_length != length:
                return False, True, st
            got = f.readinto(out)
            trailer = f.read(CHECKSUM_BYTES + 1)  # one byte more: a longer file is bad
    except OSError:
        return False, False, None  # missing (or unreadable): a plain miss
    if got != length or trailer != checksum(header, out):
        return False, True, st
    return True, False, st
