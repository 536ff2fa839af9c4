"""Reading a waiting request's disk blocks in the background, so that its admission does not
stop the scheduler (and every running request) on the disk.

When a request arrives, the blocks of its prompt beyond what the device and host tiers hold are
read in the background, several at once and each made available as soon as those before it
are, up to the chain's first miss, into one reused host buffer (the engine's: pinned on CUDA, so blocks go on to the device at the link's speed).
At admission the request claims its blocks and uploads them as they arrive; the policy says
how long it waits for the next ones (`--hicache-storage-prefetch-policy`, SGLang's names):
`wait_complete` until the chain ends, `timeout` until `--hicache-storage-prefetch-timeout`
seconds after admission began, `best_effort` not at all. What it does not take is prefilled.
A request that finds no room in the buffer, or whose prefix shrank below where its prefetch
began, is read at admission instead, as without prefetching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ...radix.storage import KVStorage

PREFETCH_MAX_BYTES = 2 << 30  # the buffer all waiting requests' blocks share
POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class Prefetch:
    """One request's blocks `first`, `first + 1`, ... as they are read into the buffer at `offset`."""

    keys: list[str]
    first: int
    offset: int
    size: int
    found: int = 0  # leading blocks read and verified; only grows
    done: bool = False  # the reader stopped (chain read, a miss, or cancelled)
    cancelled: bool = False
    dropped: bool = False  # nobody wants it: its range is freed once the reader stops
    arrived: threading.Condition = field(default_factory=threading.Condition)


class Claim:
    """A request's prefetched blocks from block `first` on, taken at its admission: `ready(j, n)`
    says how many from its j-th on are there (waiting for n as the policy allows), `data` holds them.
    Release it (StoragePrefetch.release) after the uploads are queued."""

    def __init__(self, job: Prefetch, skip: int, data: memoryview, deadline: float | None, waits: bool):
        self.job, self.skip, self.data = job, skip, data
        self._deadline, self._waits = deadline, waits
        self.waited = 0.0

    def ready(self, j: int, want: int = 1) -> int:
        """How many blocks from the claim's j-th on are read, once `want` of them are (or the
        read ended, or the policy stops waiting)."""
        job = self.job
        need = self.skip + j + want
        if self._waits and job.found < need and not job.done:
            start = time.perf_counter()
            with job.arrived:
                while job.found < need and not job.done:
                    left = None if self._deadline is None else self._deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        break
                    job.arrived.wait(left)
            self.waited += time.perf_counter() - start
        return max(0, job.found - self.skip - j)


class StoragePrefetch:
    def __init__(self, storage: KVStorage, policy: str, timeout_s: float, buffer: Callable[[], memoryview],
                 wait_uploads: Callable[[], None]):
        """buffer: hands out PREFETCH_MAX_BYTES of host memory (the engine's, reserved once);
        wait_uploads: returns when the device has copied what earlier claims uploaded from it."""
        if policy not in POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.storage = storage
        self.policy = policy
        self.timeout_s = timeout_s
        self._buffer_source = buffer
        self._buffer: memoryview | None = None
        self._wait_uploads = wait_uploads
        self._jobs: dict[str, Prefetch] = {}
        self._free: list[tuple[int, int]] = [(0, PREFETCH_MAX_BYTES)]  # (offset, size), by offset
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-storage-prefetch")
        self.stats = {"prefetched_blocks": 0, "skipped_requests": 0, "wait_seconds": 0.0}

    def start(self, rid: str, keys: list[str], first: int) -> None:
        """Starts reading blocks `keys[first:]` for request `rid` (skipped without room)."""
        if first >= len(keys):
            return
        size = (len(keys) - first) * self.storage.block_bytes
        if self._buffer is None:
            self._buffer = self._buffer_source()
        self._wait_uploads()  # a freed range may still be on its way to the device
        with self._lock:
            offset = None if rid in self._jobs else self._take_range(size)
            if offset is None:
                self.stats["skipped_requests"] += 1
                return
            job = self._jobs[rid] = Prefetch(keys[first:], first, offset, size)
        self._worker.submit(self._read, job)

    def _read(self, job: Prefetch) -> None:
        reads = self.storage.read_in_order(job.keys, self._buffer[job.offset:job.offset + job.size])
        try:
            for ok in reads:
                if not ok or job.cancelled:
                    break
                with job.arrived:
                    job.found += 1
                    job.arrived.notify_all()
        finally:
            reads.close()  # returns once no read is writing into the range
            with job.arrived:
                job.done = True
                job.arrived.notify_all()
            with self._lock:
                if job.dropped:
                    self._give_range(job)

    def claim(self, rid: str, first: int) -> Claim | None:
        """Request `rid`'s prefetched blocks from `first` on, or None when it has none to offer
        from there (no prefetch, or it began past `first`)."""
        with self._lock:
            job = self._jobs.get(rid)
        if job is None or job.first > first:
            self.forget(rid)
            return None
        deadline = time.perf_counter() + self.timeout_s if self.policy == "timeout" else None
        skip = first - job.first
        data = self._buffer[job.offset + skip * self.storage.block_bytes:job.offset + job.size]
        return Claim(job, skip, data, deadline, waits=self.policy != "best_effort")

    def release(self, rid: str, claim: Claim, used: int) -> None:
        """The claim's blocks are uploaded (`used` of them): its prefetch is over."""
        self.stats["wait_seconds"] += claim.waited
        self.stats["prefetched_blocks"] += used
        self.forget(rid)

    def forget(self, rid: str) -> None:
        """Drops request `rid`'s prefetch: a running read stops after the blocks in flight, and
        its range of the buffer is reused once those are done."""
        with self._lock:
            job = self._jobs.pop(rid, None)
            if job is not None:
                job.cancelled = job.dropped = True
                if job.done:
                    self._give_range(job)

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
        self._worker.shutdown(wait=True, cancel_futures=True)

    # ---- the buffer's free ranges (first fit; called with the lock held) ----

    def _take_range(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def _give_range(self, job: Prefetch) -> None:
        """Returns a job's range (once), merged with free neighbours."""
        if job.size == 0:
            return
        ranges = sorted(self._free + [(job.offset, job.size)])
        job.size = 0
        merged = [ranges[0]]
        for offset, size in ranges[1:]:
            last_offset, last_size = merged[-1]
            if last_offset + last_size == offset:
                merged[-1] = (last_offset, last_size + size)
            else:
                merged.append((offset, size))
        self._free = merged
