"""Loading KV back from the host tier on CUDA, layer by layer, beside the forward that reads it.

A load-back is two steps per layer: a host-to-device copy (DMA) of the layer's host rows into a
staging buffer, then a scatter of the staging buffer into the KV pool's slots. The copies run on
a side stream; the scatters run on the compute stream, inside the next forward, just before the
layer's attention (`before_layer`), so the forward computes layer l while the copy engine brings
layer l+1. The scatter is a kernel: on the side stream it would wait for free SMs behind the
forward's GEMMs and hold back the copies queued after it (measured on the H200: only a quarter
of the copy time overlapped the forward that way).

Staging is a ring of a few buffers: the copy of unit k + RING waits for the scatter of unit k
(an event the compute stream records), and is queued as soon as that scatter is, so the side
stream never waits on an event not recorded yet. A unit is one layer's rows, in chunks of at
most CHUNK_BYTES, so the ring stays small whatever the batch loads.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 128 << 20
RING = 4


class LayerLoads:
    """One batch of load-backs: `device_slots[i]` gets host slot `host_slots[i]`'s KV."""

    def __init__(self, host, device_slots: list[int], host_slots, copy_stream: torch.cuda.Stream):
        self.host = host  # HostKVPool: layout, segments, the pool and its views
        self.copy_stream = copy_stream
        self.compute = torch.cuda.current_stream(host.device)
        layer_token_bytes = host.bytes_per_token // host.num_layers
        chunk = max(1, CHUNK_BYTES // layer_token_bytes)
        self.chunks = []  # (device index tensor, host runs) per chunk of the batch
        for c in range(0, len(device_slots), chunk):
            idx = host.index(device_slots[c:c + chunk])
            self.chunks.append((idx, list(host.runs(host_slots[c:c + chunk]))))
        rows = min(len(device_slots), chunk)
        self.ring = []
        for _ in range(min(RING, host.num_layers * len(self.chunks))):
            buf = torch.empty((rows, *host.layer_shape), dtype=host.dtype, device=host.device)
            buf.record_stream(copy_stream)  # written there: not reused before those copies finish
            self.ring.append(buf)
        self.units = [(layer, c) for layer in range(host.num_layers) for c in range(len(self.chunks))]
        self.copied: list[torch.cuda.Event] = []  # per unit queued: its copy has landed
        self.freed: list[torch.cuda.Event | None] = [None] * len(self.ring)  # per ring slot: scattered
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.scattered = 0  # units scattered into the pool so far
        self.tokens = len(device_slots)
        self._queue_copies()

    def _queue_copies(self) -> None:
        """Queues the copies of every unit whose ring slot is free or will be once a scatter
        already queued has run."""
        segments = self.host.segments
        with torch.cuda.stream(self.copy_stream):
            while len(self.copied) < len(self.units) and len(self.copied) < self.scattered + len(self.ring):
                k = len(self.copied)
                layer, c = self.units[k]
                slot = k % len(self.ring)
                if self.freed[slot] is not None:
                    self.copy_stream.wait_event(self.freed[slot])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                staged = self.ring[slot]
                for a, seg, row, n in self.chunks[c][1]:
                    staged[a:a + n].copy_(segments.get(seg)[layer, row:row + n], non_blocking=True)
                end.record()
                self.timing.append((start, end))
                self.copied.append(end)

    def before_layer(self, layer: int) -> None:
        """On the compute stream: the scatters of every unit up to `layer`'s last, each after
        its copy; then the copies those scatters free ring slots for."""
        host = self.host
        last = (layer + 1) * len(self.chunks)
        while self.scattered < min(last, len(self.units)):
            k = self.scattered
            unit_layer, c = self.units[k]
            idx = self.chunks[c][0]
            staged = self.ring[k % len(self.ring)]
            self.compute.wait_event(self.copied[k])
            host.scatter_layer(unit_layer, idx, staged[:len(idx)])
            freed = torch.cuda.Event()
            freed.record(self.compute)
            self.freed[k % len(self.ring)] = freed
            self.scattered += 1
            self._queue_copies()
        if self.done:  # the allocator reuses the staging after the work queued on it
            self.ring, self.chunks = [], []

    def finish(self) -> None:
        """Every remaining layer scattered now (before a CUDA graph, which cannot stop per
        layer, or before other work that touches the slots)."""
        self.before_layer(self.host.num_layers - 1)

    @property
    def done(self) -> bool:
        return self.scattered == len(self.units)

    def copy_seconds(self) -> float | None:
        """Seconds the copies ran, once they all have (None before)."""
        if not self.timing:
            return 0.0
        if not self.done or not self.timing[-1][1].query():
            return None
        return sum(start.elapsed_time(end) for start, end in self.timing) / 1000
