"""One disk-tier block file: its bytes, and reading one back verified.

    header  HEADER: magic, format version, header length, sha256(identity), payload length
    payload exactly the block's bytes
    trailer CRC-32C of header + payload (4 bytes, little-endian)

A file of another identity or format version is not ours to judge (a replica may use it); a
short, long, garbled or wrongly sized file of ours is bad. Pure Python, like the rest of radix/.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c

MAGIC = b"RLKV"
# 3: CRC-32C trailer. 2 had zlib's CRC-32, which the CPU computes at ~2 GB/s a core and so
# halved what reader threads could read; CRC-32C has an instruction (SSE4.2, ARMv8) and runs at
# memory speed. 1 had blake2b-128: a cache file guards against truncation and garbling, not
# forgery, so a cryptographic hash bought nothing.
FORMAT_VERSION = 3
# magic, version, header length, sha256(identity), payload length
HEADER = struct.Struct("<4sHH32sQ")
CHECKSUM_BYTES = 4


def checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    # crc32c releases the GIL on large buffers, so reader threads check blocks in parallel.
    return crc32c.crc32c(payload, crc32c.crc32c(header)).to_bytes(CHECKSUM_BYTES, "little")


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
