"""KVStorage: the disk tier's blocks survive a restart, bad files are misses, writes are atomic
and bounded, and a full disk turns writes off instead of failing the server."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest

from radixlm.radix import block_file, storage
from radixlm.radix.storage import KVStorage, StorageError

BLOCK_TOKENS = 4
BLOCK_BYTES = 64
IDENTITY = "model-a/bf16/kv-bf16/page1/tp0"


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(BLOCK_BYTES))


@pytest.fixture
def store(tmp_path):
    s = KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES)
    yield s
    s.close()


def block_files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("*/*.kv"))


def test_round_trip_and_restart(tmp_path, store):
    key = store.block_keys(range(BLOCK_TOKENS))[0]
    assert not store.contains(key) and store.get(key) is None
    store.put(key, memoryview(payload(1)))
    store.flush()
    assert store.contains(key)
    assert store.get(key) == payload(1)
    st = store.stats
    assert (st["hits"], st["misses"], st["files"], st["bytes_read"]) == (1, 1, 1, BLOCK_BYTES)
    assert st["bytes_written"] == st["size_bytes"] == store.file_bytes
    assert (store.directory / key[:2] / f"{key}.kv").is_file()

    # A restarted server (or a replica) on the same directory reads it, and counts it at start.
    with KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES) as again:
        assert again.stats["files"] == 1
        assert again.block_keys(range(BLOCK_TOKENS)) == [key]
        assert again.get(key) == payload(1)


def test_a_chain_is_read_in_parallel_up_to_its_first_miss(store):
    keys = store.block_keys(range(5 * BLOCK_TOKENS))
    for i in (0, 1, 2, 4):  # block 3 is missing: block 4 cannot be used
        store.put(keys[i], payload(i))
    store.flush()
    out = bytearray(5 * BLOCK_BYTES)
    assert store.get_many_into(keys, memoryview(out)) == 3
    assert bytes(out[:3 * BLOCK_BYTES]) == payload(0) + payload(1) + payload(2)
    assert store.get_many_into(keys[:2], memoryview(out)) == 2
    assert store.get_many_into(keys[3:], memoryview(out)) == 0
    with pytest.raises(ValueError, match="out has"):
        store.get_many_into(keys, memoryview(out)[:BLOCK_BYTES])


def test_blocks_arrive_in_order_as_soon_as_ready_and_closing_leaves_no_read_behind(store, monkeypatch):
    """read_in_order yields block i once blocks 0..i are read, without waiting for a slow block
    after it; closing it early skips the blocks not begun and returns only once the reads in
    flight are done, so the buffer can be handed to another request."""
    keys = store.block_keys(range(40 * BLOCK_TOKENS))
    for i, key in enumerate(keys):
        store.put(key, payload(i))
    store.flush()
    read = store.get_into
    started, finished, slow = [], [], {keys[5]}

    def get_into(key, out):
        started.append(key)
        time.sleep(0.5 if key in slow else 0.01)
        ok = read(key, out)
        finished.append(key)
        return ok

    monkeypatch.setattr(store, "get_into", get_into)
    out = bytearray(40 * BLOCK_BYTES)
    reads = store.read_in_order(keys, memoryview(out))
    t0 = time.perf_counter()
    assert [next(reads) for _ in range(5)] == [True] * 5
    assert time.perf_counter() - t0 < 0.4  # not held back by block 5, read beside them
    assert next(reads) and bytes(out[5 * BLOCK_BYTES:6 * BLOCK_BYTES]) == payload(5)
    slow.update(keys[6:])  # every later read is slow: closing must wait for those in flight
    reads.close()
    done = len(started)
    assert len(finished) == done  # no read still writing into `out`
    time.sleep(0.6)
    assert len(started) == done < len(keys)  # nothing started after close returned
    assert len(started) <= 6 + storage.READ_AHEAD  # at most READ_AHEAD queued ahead


def test_put_skips_existing_key(store):
    key = store.block_keys(range(BLOCK_TOKENS))[0]
    store.put(key, payload(1))
    store.flush()
    store.put(key, payload(2))
    store.flush()
    assert store.get(key) == payload(1)
    assert store.stats["bytes_written"] == store.file_bytes


def test_block_keys(tmp_path, store):
    tokens = list(range(100, 100 + 3 * BLOCK_TOKENS + 2))  # 3 full blocks and a partial one
    keys = store.block_keys(tokens)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    assert store.block_keys(tokens[:2 * BLOCK_TOKENS]) == keys[:2]  # chain: prefix -> prefix
    assert store.block_keys(tokens[:BLOCK_TOKENS - 1]) == []
    # The chain: a block's key depends on everything before it.
    changed = [tokens[0] + 1] + tokens[1:]
    assert not set(store.block_keys(changed)) & set(keys)

    salted = store.block_keys(tokens, namespace="adapter-1")
    assert not set(salted) & set(keys)
    assert not set(salted) & set(store.block_keys(tokens, namespace="adapter-2"))
    assert store.block_keys(tokens, namespace="adapter-1") == salted  # deterministic
    with KVStorage(tmp_path / "other", "model-b", BLOCK_TOKENS, BLOCK_BYTES) as other:
        assert not set(other.block_keys(tokens)) & set(keys)


def test_foreign_identity_is_a_miss(tmp_path, store):
    key = store.block_keys(range(BLOCK_TOKENS))[0]
    store.put(key, payload(1))
    store.flush()
    with KVStorage(store.directory, "model-b", BLOCK_TOKENS, BLOCK_BYTES) as foreign:
        assert foreign.contains(key)  # contains does not read
        assert foreign.get(key) is None
        assert foreign.stats["misses"] == 1 and foreign.stats["corrupt"] == 0
    assert store.get(key) == payload(1)  # left alone: it is valid for its own model

    # A file of a newer format version is a miss too, and left for the server that wrote it.
    path = store.directory / key[:2] / f"{key}.kv"
    data = bytearray(path.read_bytes())
    data[4:6] = (block_file.FORMAT_VERSION + 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert store.get(key) is None and path.exists() and store.stats["corrupt"] == 0


def test_bad_files_are_misses(store):
    keys = store.block_keys(range(4 * BLOCK_TOKENS))
    for i, key in enumerate(keys):
        store.put(key, payload(i))
    store.flush()
    path = lambda k: store.directory / k[:2] / f"{k}.kv"
    data = path(keys[0]).read_bytes()

    path(keys[0]).write_bytes(data[:len(data) // 2])  # truncated in the payload
    path(keys[1]).write_bytes(data[:10])  # truncated in the header
    flipped = bytearray(path(keys[2]).read_bytes())
    flipped[block_file.HEADER.size + 5] ^= 0xFF
    path(keys[2]).write_bytes(bytes(flipped))
    path(keys[3]).write_bytes(path(keys[3]).read_bytes() + b"x")  # too long

    for key in keys:
        assert store.get(key) is None
        assert not path(key).exists()  # deleted
    st = store.stats
    assert st["corrupt"] == 4 and st["misses"] == 4 and st["hits"] == 0
    assert st["files"] == 0  # (size_bytes drops by the bad files' sizes on disk, not ours)


def test_wrong_payload_size_and_bad_key(store):
    key = store.block_keys(range(BLOCK_TOKENS))[0]
    with pytest.raises(ValueError, match="bytes"):
        store.put(key, b"x" * (BLOCK_BYTES - 1))
    with pytest.raises(ValueError, match="block key"):
        store.get("../../etc/passwd")
    with pytest.raises(ValueError):
        KVStorage(store.directory, IDENTITY, 0, BLOCK_BYTES)


def test_write_is_atomic(store, monkeypatch):
    """The block is written under a temporary name and renamed: if the rename never happens, no
    file appears under the final name, and the temporary file is cleaned up."""
    seen = []

    def failing_replace(src, dst):
        seen.append((os.path.basename(src), os.path.exists(src), os.path.exists(dst)))
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(storage.os, "replace", failing_replace)
    key = store.block_keys(range(BLOCK_TOKENS))[0]
    store.put(key, payload(1))
    store.flush()
    monkeypatch.undo()
    [(name, src_existed, dst_existed)] = seen
    assert name.startswith(".") and name != f"{key}.kv"
    assert src_existed and not dst_existed
    assert not store.contains(key) and store.get(key) is None
    assert list(store.directory.rglob("*")) == [store.directory / key[:2]]  # no temp file left
    assert store.stats["write_errors"] == 1 and store.writes_enabled


def test_size_bound_evicts_oldest(tmp_path):
    probe = KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES)
    file_bytes = probe.file_bytes
    probe.close()
    keys = probe.block_keys(range(5 * BLOCK_TOKENS))
    with KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES,
                   max_bytes=3 * file_bytes + file_bytes // 2) as s:
        base = time.time() - 1000
        for i, key in enumerate(keys):
            s.put(key, payload(i))
            s.flush()
            # Distinct mtimes, whatever the file system's clock granularity.
            os.utime(s.directory / key[:2] / f"{key}.kv", (base + i, base + i))
        left = [k for k in keys if s.contains(k)]
        assert len(left) <= 3
        assert keys[0] not in left and keys[-1] in left
        assert s.stats["files"] == len(left)
        assert s.stats["size_bytes"] == len(left) * file_bytes <= s.max_bytes


def test_hit_refreshes_lru(tmp_path):
    with KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES) as s:
        key = s.block_keys(range(BLOCK_TOKENS))[0]
        s.put(key, payload(0))
        s.flush()
        path = s.directory / key[:2] / f"{key}.kv"
        os.utime(path, (1000, 1000))
        assert s.get(key) == payload(0)
        assert path.stat().st_mtime > 1000


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match=str(blocker / "kv")):
        KVStorage(blocker / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES)
    with pytest.raises(StorageError, match="not a directory|cannot create"):
        KVStorage(blocker, IDENTITY, BLOCK_TOKENS, BLOCK_BYTES)


def test_disk_full_turns_writes_off(store, monkeypatch, caplog):
    keys = store.block_keys(range(3 * BLOCK_TOKENS))
    store.put(keys[0], payload(0))
    store.flush()

    def full(path, chunks):
        with open(path, "xb"):
            pass  # the temp file exists, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "_write_file", full)
    with caplog.at_level(logging.WARNING, logger="radixlm.radix.storage"):
        store.put(keys[1], payload(1))  # no exception reaches the caller
        store.flush()
        store.put(keys[2], payload(2))  # a no-op now
        store.flush()
    assert store.writes_enabled is False and store.stats["writes_enabled"] is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(store.directory) in warnings[0].getMessage()
    assert store.stats["write_errors"] == 1
    assert not store.contains(keys[1]) and not store.contains(keys[2])
    assert block_files(store.directory) == [f"{keys[0]}.kv"]  # the temp file was removed
    assert not [p for p in store.directory.rglob(".*") if p.is_file()]
    assert store.get(keys[0]) == payload(0)  # reads go on


def test_full_queue_drops(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "MAX_PENDING_BYTES", BLOCK_BYTES)  # room for one queued block
    started, release = threading.Event(), threading.Event()
    write_file = storage._write_file

    def slow(path, chunks):
        started.set()
        assert release.wait(5)
        write_file(path, chunks)

    with KVStorage(tmp_path / "kv", IDENTITY, BLOCK_TOKENS, BLOCK_BYTES) as s:
        monkeypatch.setattr(storage, "_write_file", slow)  # after the start-up probe
        keys = s.block_keys(range(4 * BLOCK_TOKENS))
        s.put(keys[0], payload(0))
        assert started.wait(5)  # the writer holds block 0
        t0 = time.monotonic()
        for i, key in enumerate(keys[1:], 1):
            s.put(key, payload(i))  # block 1 queued, 2 and 3 dropped
        assert time.monotonic() - t0 < 1  # never blocks on the writer
        release.set()
        s.flush()
        assert s.stats["writes_dropped"] == 2
        assert [s.contains(k) for k in keys] == [True, True, False, False]


def test_clear_and_close(tmp_path, store):
    keys = store.block_keys(range(3 * BLOCK_TOKENS))
    for i, key in enumerate(keys):
        store.put(key, payload(i))
    other = store.directory / "notes.txt"
    other.write_text("not ours")
    assert store.clear() == 3
    assert block_files(store.directory) == [] and other.exists()
    assert store.stats["files"] == 0 and store.stats["size_bytes"] == 0
    assert all(store.get(k) is None for k in keys)
    store.close()
    store.close()  # idempotent
    store.put(keys[0], payload(0))  # after close: ignored
    assert not store.contains(keys[0])


def test_prefetch_shares_one_buffer_and_reuses_freed_ranges(store, monkeypatch):
    """Waiting requests' blocks go into one buffer: a request that finds no room is skipped
    (read at admission instead), a forgotten or released one's range is reused, and a claim
    yields the blocks read, in order, up to the chain's first miss."""
    from radixlm.srt.scheduler import storage_prefetch

    monkeypatch.setattr(storage_prefetch, "PREFETCH_MAX_BYTES", 5 * BLOCK_BYTES)
    keys = store.block_keys(range(4 * BLOCK_TOKENS))
    for i, key in enumerate(keys[:3]):  # block 3 is missing: the chain ends there
        store.put(key, memoryview(payload(i)))
    store.flush()
    buffer = bytearray(5 * BLOCK_BYTES)
    uploads_waited = []
    prefetch = storage_prefetch.StoragePrefetch(store, "wait_complete", 1.0, lambda: memoryview(buffer),
                                                lambda: uploads_waited.append(True))
    try:
        prefetch.start("a", keys, 0)  # 4 blocks of the 5 the buffer holds
        prefetch.start("b", keys, 2)  # 2 more: no room
        assert prefetch.stats["skipped_requests"] == 1
        claim = prefetch.claim("a", 1)  # its prefix grew by a block meanwhile
        assert claim.ready(0, 3) == 2 and claim.ready(1) == 1 and claim.ready(2) == 0
        assert bytes(claim.data[:2 * BLOCK_BYTES]) == payload(1) + payload(2)
        prefetch.release("a", claim, 2)
        assert prefetch.stats["prefetched_blocks"] == 2
        prefetch.start("b", keys, 0)  # a's range is free again
        assert prefetch.stats["skipped_requests"] == 1 and uploads_waited
        assert prefetch.claim("b", 0).ready(3) == 0  # waits for b's reader to stop
        prefetch.forget("b")
        assert prefetch.claim("b", 0) is None
        prefetch.start("c", keys, 0)
        assert prefetch.claim("c", 0).ready(0, 4) == 3
    finally:
        prefetch.close()
