"""Reading a waiting request's disk blocks in the background, so that its admission does not
stop the scheduler (and every running request) on the disk.

When a request arrives, the blocks of its prompt beyond what the device and host tiers hold are
read into host memory by a background thread, a few at a time, up to the chain's first miss.
At admission the policy says how long to wait for them (`--hicache-storage-prefetch-policy`,
SGLang's names): `wait_complete` waits for the whole chain, `timeout` for at most
`--hicache-storage-prefetch-timeout` seconds, `best_effort` not at all; the request takes the
blocks read by then, and prefills the rest. Prefetched bytes are bounded (PREFETCH_MAX_BYTES);
a request that finds no room, or whose prefix shrank below where its prefetch began, is read
at admission instead, as without prefetching.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ...radix.storage import READ_THREADS, KVStorage

PREFETCH_MAX_BYTES = 2 << 30  # host memory held by prefetched blocks, all requests together
# Blocks read at once by a prefetch (storage.get_many_into), one per reader thread: what
# best_effort can take early.
ROUND_BLOCKS = READ_THREADS
POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class Prefetch:
    """One request's blocks `first`, `first + 1`, ... as they are read into `data`."""

    keys: list[str]
    first: int
    data: np.ndarray  # uint8, uninitialised: zeroing gigabytes on the scheduler's thread cost ~0.3 s/GB
    found: int = 0  # leading blocks read and verified
    done: bool = False
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)


class StoragePrefetch:
    def __init__(self, storage: KVStorage, policy: str, timeout_s: float):
        if policy not in POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.storage = storage
        self.policy = policy
        self.timeout_s = timeout_s
        self._jobs: dict[str, Prefetch] = {}
        self._held = 0  # bytes of the jobs in _jobs
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-storage-prefetch")
        self.stats = {"prefetched_blocks": 0, "skipped_requests": 0, "wait_seconds": 0.0}

    def start(self, rid: str, keys: list[str], first: int) -> None:
        """Starts reading blocks `keys[first:]` for request `rid` (skipped without room)."""
        if first >= len(keys):
            return
        size = (len(keys) - first) * self.storage.block_bytes
        with self._lock:
            if self._held + size > PREFETCH_MAX_BYTES or rid in self._jobs:
                self.stats["skipped_requests"] += 1
                return
            job = self._jobs[rid] = Prefetch(keys[first:], first, np.empty(size, dtype=np.uint8))
            self._held += size
        self._worker.submit(self._read, job)

    def _read(self, job: Prefetch) -> None:
        size = self.storage.block_bytes
        view = memoryview(job.data)
        try:
            while job.found < len(job.keys) and not job.cancelled:
                batch = job.keys[job.found:job.found + ROUND_BLOCKS]
                got = self.storage.get_many_into(batch, view[job.found * size:(job.found + len(batch)) * size])
                job.found += got  # only ever grows: admission reads it without the lock
                if got < len(batch):
                    break
        finally:
            job.done = True
            job.finished.set()

    def take(self, rid: str, first: int) -> tuple[memoryview, int] | None:
        """The blocks from `first` on that request `rid`'s prefetch has read once the policy
        stops waiting: (their bytes, how many), or None when it has none to offer from there
        (no prefetch, or it began past `first`). The prefetch is over after this."""
        with self._lock:
            job = self._jobs.get(rid)
        if job is None or job.first > first:
            self.forget(rid)
            return None
        start = time.perf_counter()
        if self.policy == "wait_complete":
            job.finished.wait()
        elif self.policy == "timeout":
            job.finished.wait(self.timeout_s)
        self.stats["wait_seconds"] += time.perf_counter() - start
        job.cancelled = True  # a read still running stops after its round
        found = job.found - (first - job.first)
        data = memoryview(job.data)[(first - job.first) * self.storage.block_bytes:]
        self.forget(rid)
        if found > 0:
            self.stats["prefetched_blocks"] += found
        return data, max(0, found)

    def forget(self, rid: str) -> None:
        """Drops request `rid`'s prefetch (its memory is free once a running read stops)."""
        with self._lock:
            job = self._jobs.pop(rid, None)
            if job is not None:
                job.cancelled = True
                self._held -= job.data.nbytes

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
        self._worker.shutdown(wait=True, cancel_futures=True)
