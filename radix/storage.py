"""The disk tier of the KV prefix cache: fixed-size KV blocks in files that outlive the process.

A block holds the KV of `block_tokens` tokens and is named by a hash chain over the token ids
(`block_keys`), seeded by the model's identity and the request's namespace, so a restarted
server, or another replica pointed at the same directory, finds the blocks it can reuse.

Layout: `directory/<key[:2]>/<key>.kv` (a two-level fan-out keeps directories small); a file's
bytes and their checks are block_file.py's.

Writes go through one background thread: the scheduler only copies the payload and queues it.
Each write goes to a temporary file in the same folder and is renamed over the final name
(os.replace is atomic), so a reader never sees a half-written block under a final name. There
is no fsync: after a crash a block may be short or garbled, which the checksum turns into a
miss, and a cache can afford to lose it. A bad file is a miss, never an exception.

Pure Python + numpy (no torch), like the rest of radix/.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import closing
from pathlib import Path
from typing import Self

import numpy as np

from .block_file import CHECKSUM_BYTES, HEADER, block_chunks, read_block

__all__ = ["KVStorage", "StorageError"]

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
_KEY = re.compile(r"[0-9a-f]{64}")
_FANOUT = re.compile(r"[0-9a-f]{2}")
# Queued payloads are held in memory: bound them by bytes, not by count, since a block can be
# megabytes (8 MB for 64 tokens of an 8B model). Big enough for a 16k-token prompt of such a
# model saved at once (2 GB); beyond it a put is dropped. At least one block always fits.
MAX_PENDING_BYTES = 4 << 30
# A temporary file this old was left by a writer that died (a live one renames within seconds).
STALE_TEMP_S = 3600.0
# Blocks read at once (read_in_order): reading and checking a block keep a core busy (both
# release the GIL) or wait on the disk, so one thread per core, at least 8 and at most 16.
READ_THREADS = max(8, min(16, os.cpu_count() or 8))
READ_AHEAD = 2 * READ_THREADS  # blocks of one chain queued for the readers at a time
# Eviction goes below the bound by this fraction, so a full tier rescans once per batch of
# writes rather than once per write.
EVICT_LOW_WATER = 0.9


class StorageError(ValueError):
    """The storage directory cannot be used (start-up only; the message names the directory)."""


def _write_file(path: str, chunks: Sequence[bytes | memoryview]) -> None:
    """Write `chunks` to a new file at `path` (fails if it exists). One function, so tests can
    make the disk full here."""
    with open(path, "xb") as f:
        f.writelines(chunks)


class KVStorage:
    """Blocks of `block_bytes` bytes in `directory`, for the model named by `identity`.

    identity: the caller's model identity (weights fingerprint, dtype, KV dtype, page size, TP
        rank). It seeds the key chain and is recorded in every header, so a file of another
        model is a miss.
    max_bytes: bound on the files' total size; after a write that exceeds it the least recently
        used files (by mtime, which a hit refreshes) are deleted. None: unbounded.

    stats["files"] / stats["size_bytes"] come from a scan at start-up, updated by this
    instance's own writes and deletions; files that other processes add or remove are seen at
    the next eviction, which rescans.
    """

    def __init__(self, directory: str | os.PathLike, identity: str, block_tokens: int,
                 block_bytes: int, max_bytes: int | None = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.directory = Path(directory)
        self.identity = identity
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.max_bytes = max_bytes
        self.file_bytes = HEADER.size + block_bytes + CHECKSUM_BYTES
        self._identity_hash = hashlib.sha256(identity.encode()).digest()
        self._check_directory()

        self._lock = threading.Lock()  # counters, pending set, size
        self._idle = threading.Condition(self._lock)  # notified when nothing is pending
        self._hits = self._misses = self._corrupt = 0
        self._bytes_read = self._bytes_written = 0
        self._writes_dropped = self._write_errors = 0
        self._warned_error = False
        self.writes_enabled = True
        self._pending: set[str] = set()  # queued or being written
        self._readers: ThreadPoolExecutor | None = None  # get_many_into's, made on first use
        self._closed = False
        self._files, self._size = self._scan()[:2]
        if max_bytes is not None and self._size > max_bytes:
            self._evict()

        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(
            maxsize=max(1, MAX_PENDING_BYTES // block_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="kv-storage-writer", daemon=True)
        self._writer.start()

    # ---- start-up ----

    def _check_directory(self) -> None:
        where = f"--hicache-storage-dir {self.directory}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{where}: cannot create the directory: {e}") from None
        if not self.directory.is_dir():
            raise StorageError(f"{where}: not a directory")
        # Permissions alone do not tell (root, read-only mounts, ACLs): write and remove a file.
        probe = self.directory / f".probe.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}"
        try:
            _write_file(str(probe), [b"probe"])
            probe.unlink()
        except OSError as e:
            raise StorageError(f"{where}: not writable: {e}") from None

    def _scan(self) -> tuple[int, int, list[tuple[float, int, Path]]]:
        """(file count, total size, [(mtime, size, path)]) of our block files; removes stale
        temporary files on the way."""
        files, size, entries = 0, 0, []
        now = time.time()
        try:
            subdirs = [d for d in os.scandir(self.directory) if _FANOUT.fullmatch(d.name) and d.is_dir()]
        except OSError:
            return 0, 0, []
        for sub in subdirs:
            try:
                children = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in children:
                try:
                    st = entry.stat()
                except OSError:
                    continue  # deleted meanwhile
                name = entry.name
                if name.endswith(SUFFIX) and _KEY.fullmatch(name[:-len(SUFFIX)]):
                    files += 1
                    size += st.st_size
                    entries.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif name.startswith(".") and name.endswith(TEMP_SUFFIX) and now - st.st_mtime > STALE_TEMP_S:
                    _unlink(entry.path)
        return files, size, entries

    # ---- keys and paths ----

    def block_keys(self, tokens: Sequence[int], namespace: Hashable = None) -> list[str]:
        """One hex key per full block of `tokens` (a partial last block has none):
        key_i = sha256(key_{i-1} || int64-LE tokens of block i), key_{-1} = sha256(identity
        || 0 || repr(namespace)). The chain makes a key name its whole prefix, so a prefix of
        the tokens gives a prefix of the keys. namespace should have a stable repr (str, int,
        tuple of those): it is what keeps cache salts / adapters apart across processes."""
        ids = np.asarray(tokens, dtype="<i8").reshape(-1)
        prev = hashlib.sha256(self.identity.encode() + b"\0" + repr(namespace).encode()).digest()
        keys = []
        bt = self.block_tokens
        for start in range(0, len(ids) - bt + 1, bt):
            h = hashlib.sha256(prev)
            h.update(ids[start:start + bt].tobytes())
            prev = h.digest()
            keys.append(h.hexdigest())
        return keys

    def _path(self, key: str) -> Path:
        # Keys become file names: anything else could point outside the directory.
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"not a block key (64 lowercase hex digits): {key!r}")
        return self.directory / key[:2] / (key + SUFFIX)

    # ---- reads ----

    def contains(self, key: str) -> bool:
        """Whether a file exists under `key` (not read, so get may still miss)."""
        return self._path(key).is_file()

    def get(self, key: str) -> bytes | None:
        """The block's payload, verified; None when it is missing or bad. A bad file of our
        model (short, wrong size, checksum mismatch) is deleted and counted in stats["corrupt"];
        a file of another identity or format version is left alone (a replica may use it)."""
        out = bytearray(self.block_bytes)
        return bytes(out) if self.get_into(key, memoryview(out)) else None

    def get_into(self, key: str, out: memoryview) -> bool:
        """Reads the block's payload into `out` (`block_bytes` long) and verifies it there;
        False when it is missing or bad (as `get`; `out` then holds anything)."""
        if len(out) != self.block_bytes:
            raise ValueError(f"out has {len(out)} bytes, a block {self.block_bytes}")
        path = self._path(key)
        ok, bad, st = read_block(path, self._identity_hash, out)
        if not ok:
            deleted = bad and _unlink_if_same(path, st)
            with self._lock:
                self._misses += 1
                self._corrupt += bad
                if deleted:
                    self._files -= 1
                    self._size = max(0, self._size - st.st_size)
            return False
        try:
            os.utime(path)  # a hit is a use: the size bound evicts by mtime
        except OSError:
            pass
        with self._lock:
            self._hits += 1
            self._bytes_read += self.block_bytes
        return True

    def get_many_into(self, keys: Sequence[str], out: memoryview) -> int:
        """Reads the blocks of `keys` into consecutive `block_bytes` slices of `out`, several at
        once; returns how many leading blocks were read: a chain is only usable up to its
        first miss."""
        if len(keys) <= 1:
            return int(bool(keys) and self.get_into(keys[0], out[:self.block_bytes]))
        found = 0
        with closing(self.read_in_order(keys, out)) as reads:
            for ok in reads:
                if not ok:
                    break
                found += 1
        return found

    def read_in_order(self, keys: Sequence[str], out: memoryview) -> Iterator[bool]:
        """Reads the blocks of `keys` into consecutive `block_bytes` slices of `out` on
        READ_THREADS threads (file reads and checksums release the GIL) and yields, in key
        order, whether each was read, as soon as it and those before it are done: no block
        waits for a slower one read beside it. At most READ_AHEAD blocks are queued at a time,
        so other reads queue behind a long chain's few. Closing the iterator early skips the
        blocks not begun and returns once those in flight are done, so `out` may be reused."""
        size = self.block_bytes
        if len(out) < len(keys) * size:
            raise ValueError(f"out has {len(out)} bytes, {len(keys)} blocks need {len(keys) * size}")
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-storage-reader")

        def submit(i: int) -> Future:
            return self._readers.submit(self.get_into, keys[i], out[i * size:(i + 1) * size])

        reads = deque(submit(i) for i in range(min(READ_AHEAD, len(keys))))
        queued = len(reads)
        try:
            while reads:
                ok = reads[0].result()
                reads.popleft()
                if queued < len(keys):
                    reads.append(submit(queued))
                    queued += 1
                yield ok
        finally:
            for read in reads:
                read.cancel()
            wait(reads)

    # ---- writes ----

    def put(self, key: str, payload: bytes | memoryview, owned: bool = False) -> None:
        """Queue `payload` to be written under `key`; returns at once. It is copied now unless
        `owned` (the caller hands it over and never changes it: no copy of a large save).
        Nothing happens if the key exists or is queued, or writes are off; a full queue drops it."""
        path = self._path(key)
        size = memoryview(payload).nbytes
        if size != self.block_bytes:
            raise ValueError(f"payload is {size} bytes, a block is {self.block_bytes}")
        with self._lock:
            if self._closed or not self.writes_enabled or key in self._pending:
                return
        if path.exists():
            return
        data = payload if owned else bytes(payload)  # else the caller may reuse its buffer
        with self._lock:
            if key in self._pending:
                return
            try:
                self._queue.put_nowait((key, data))
            except queue.Full:
                self._writes_dropped += 1
                return
            self._pending.add(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write is done (or `timeout` seconds have passed)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending, timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, data = item
            try:
                if self.writes_enabled:
                    self._write(key, data)
                else:
                    with self._lock:
                        self._writes_dropped += 1
            except Exception:  # never let the writer die: later puts would hang flush
                logger.exception("KV storage %s: writing block %s failed", self.directory, key)
                with self._lock:
                    self._write_errors += 1
            finally:
                with self._lock:
                    self._pending.discard(key)
                    if not self._pending:
                        self._idle.notify_all()

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if path.exists():  # another replica wrote it meanwhile
            return
        tmp = path.with_name(f".{key}.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # parents: the directory may be wiped
            _write_file(str(tmp), block_chunks(self._identity_hash, data))
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self._write_failed(e)
            return
        with self._lock:
            self._files += 1
            self._size += self.file_bytes
            self._bytes_written += self.file_bytes
            over = self.max_bytes is not None and self._size > self.max_bytes
        if over:
            self._evict()

    def _write_failed(self, e: OSError) -> None:
        with self._lock:
            self._write_errors += 1
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full disk stays full: stop trying rather than fail every block.
                if self.writes_enabled:
                    self.writes_enabled = False
                    logger.warning("KV storage %s: disk full (%s); writes to the disk tier are off, "
                                   "reads go on", self.directory, e)
                return
            first = not self._warned_error
            self._warned_error = True
        if first:
            logger.warning("KV storage %s: a block write failed (%s); further failures are only "
                           "counted", self.directory, e)

    def _evict(self) -> None:
        """Delete the least recently used files until the total is under the low-water mark.
        Rescans, so other processes' files count too."""
        files, size, entries = self._scan()
        target = self.max_bytes * EVICT_LOW_WATER if size > self.max_bytes else size
        entries.sort(key=lambda e: e[0])
        for _, file_size, path in entries:
            if size <= target:
                break
            if _unlink(path):
                files -= 1
                size -= file_size
        with self._lock:
            self._files, self._size = files, size

    # ---- maintenance ----

    def clear(self) -> int:
        """Delete every block file in the directory (queued writes land first, so none comes
        back after); returns how many were deleted. Other files are left alone."""
        self.flush()
        removed = 0
        for _, _, path in self._scan()[2]:
            removed += _unlink(path)
        files, size = self._scan()[:2]
        with self._lock:
            self._files, self._size = files, size
        return removed

    def close(self) -> None:
        """Finish queued writes and stop the writer thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # put is a no-op from now on
        self.flush()
        self._queue.put(None)
        self._writer.join()
        if self._readers is not None:
            self._readers.shutdown()

    @property
    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "hits": self._hits, "misses": self._misses, "corrupt": self._corrupt,
                "bytes_read": self._bytes_read, "bytes_written": self._bytes_written,
                "writes_dropped": self._writes_dropped, "write_errors": self._write_errors,
                "writes_enabled": self.writes_enabled, "files": self._files, "size_bytes": self._size,
            }

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink(path: str | os.PathLike) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _unlink_if_same(path: Path, st: os.stat_result) -> bool:
    """Delete `path` if it is still the file `st` describes: a replica may have just renamed a
    good block over the bad one we read."""
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
    except OSError:
        return False
    return _unlink(path)
