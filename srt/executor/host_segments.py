"""The host tier's memory: fixed-size segments of host memory, page-locked on CUDA.

Page-locked (pinned) memory is what lets a host-to-device copy run asynchronously at the
link's bandwidth, but pinning is slow and, through torch's allocator, stalls the process's
kernel launches while it runs. Measured on the H200's host: `torch.empty(...,
pin_memory=True)` pinned 2.6 GB/s with one thread and 2.8 with four (the driver serialises
them), and a kernel launch waited up to 1.4 s behind it; an anonymous mapping advised to use
huge pages, touched, then registered with `cudaHostRegister` pinned 14 GB/s and stalled a
launch by at most 28 ms a GiB, and copies from it ran at the same 51 GB/s. So on CUDA each
segment is mapped, touched and registered (in short calls) by one background thread from
start-up on, in the order slots are handed out (a 78 GB tier takes ~6 s); a copy waits only
for a segment not ready yet. On CPU a segment is plain memory allocated when first used.

That background work (touching pages on every core, then holding the driver) slows a request's
KV load from disk or host beside it to about half its speed (docs/hicache.md, the restart
profile). So a load defers the pinning (PinningGate): the worker waits between pieces while one
is under way, unless a copy is waiting for a segment it has not pinned yet.
"""

from __future__ import annotations

import logging
import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

REGISTER_BYTES = 256 << 20  # pinned per driver call: a launch waits ~7 ms at most behind one


class PinningGate:
    """Background pinning waits while a latency-critical load runs (defer), without a release
    that could be forgotten: a deferral expires by itself."""

    def __init__(self) -> None:
        self._until = 0.0

    def defer(self, seconds: float) -> None:
        """No background pinning begins for `seconds` from now (unless a copy needs it)."""
        self._until = max(self._until, time.monotonic() + seconds)

    def wait(self, needed) -> None:
        """Returns once no deferral holds or `needed()` is true."""
        while not needed() and (left := self._until - time.monotonic()) > 0:
            time.sleep(min(left, 0.002))


class HostSegments:
    """`count` segments of `shape(i)` elements of `dtype`; `get(i)` waits for segment i."""

    def __init__(self, count: int, shape, dtype: torch.dtype, pinned: bool, gate: PinningGate | None = None):
        """gate: pinning pauses between pieces while it defers (none: never)."""
        self._shape, self._dtype, self._pinned = shape, dtype, pinned
        self._gate = gate
        self._needed = False  # a copy waits for a segment not pinned yet: no more deferring
        self._mappings: list[tuple[mmap.mmap, list[int]] | None] = [None] * count
        self._segments: list[torch.Tensor | Future | None] = [None] * count
        self.wait_seconds = 0.0
        self._worker: ThreadPoolExecutor | None = None
        if pinned:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-kv-pin")
            self._segments = [self._worker.submit(self._pin, i) for i in range(count)]

    def get(self, index: int) -> torch.Tensor:
        seg = self._segments[index]
        if isinstance(seg, Future):
            self._needed = True
            start = time.perf_counter()
            seg = seg.result()  # raises what pinning raised
            self.wait_seconds += time.perf_counter() - start
            self._segments[index] = seg
        elif seg is None:
            seg = self._segments[index] = torch.empty(self._shape(index), dtype=self._dtype)
        return seg

    @property
    def allocated_bytes(self) -> int:
        done = [s.result() if isinstance(s, Future) and s.done() and not s.cancelled() else s
                for s in self._segments]
        return sum(s.numel() * s.element_size() for s in done if isinstance(s, torch.Tensor))

    def piece_bytes(self, index: int) -> int:
        """Segment `index` is registered with the driver in pieces of this many bytes (the last
        one shorter). Short calls, so launches wait less, each of whole rows of the first
        dimension (a host tier's layers): CUDA refuses a copy that spans two registrations as an
        invalid argument, and a layer's run of slots is one copy. A row longer than
        REGISTER_BYTES is a piece alone."""
        shape = self._shape(index)
        nbytes = torch.Size(shape).numel() * self._dtype.itemsize
        row_bytes = nbytes // shape[0] if shape[0] else nbytes
        return max(1, REGISTER_BYTES // row_bytes) * row_bytes

    def _pin(self, index: int) -> torch.Tensor:
        shape = self._shape(index)
        nbytes = torch.Size(shape).numel() * self._dtype.itemsize
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        base = tensor.data_ptr()
        registered = []
        step = self.piece_bytes(index)
        for offset in range(0, nbytes, step):
            size = min(step, nbytes - offset)
            if self._gate is not None:
                self._gate.wait(lambda: self._needed)
            tensor[offset:offset + size].zero_()  # fault the pages in here, not inside the driver call
            err = torch.cuda.cudart().cudaHostRegister(base + offset, size, 0)
            if int(err) != 0:  # still usable, only slower: copies from it are synchronous
                logger.warning("host KV segment %d: cudaHostRegister failed (%s); part of it stays pageable",
                               index, err)
                break
            registered.append(base + offset)
            time.sleep(0)  # let a waiting launch take the driver first
        self._mappings[index] = (mapping, registered)
        return tensor.view(self._dtype).view(shape)

    def close(self) -> None:
        """Stops pinning segments not begun and unpins the rest (after the device is idle)."""
        if self._worker is None:
            return
        self._worker.shutdown(wait=True, cancel_futures=True)
        torch.cuda.synchronize()
        for entry in self._mappings:
            for ptr in entry[1] if entry is not None else ():
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._mappings = []
        self._segments = []  # the mappings go with their last tensor
        self._worker = None
