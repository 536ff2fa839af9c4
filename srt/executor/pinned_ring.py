"""Small per-step host tables (int32) on their way to the device, through pinned buffers reused in turn.

A copy from pinned memory is asynchronous: it queues behind the running step instead of
waiting for it, which overlap scheduling needs. Pinning a fresh tensor every step
(Tensor.pin_memory) did that at a price larger than building the tables (docs/deterministic.md
has the profile). Here each of a few buffers is written again only once the copy that last
read it has run (its CUDA event, long done by then), and the tables are concatenated straight
into it, converted to int32 on the way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING_BUFFERS = 3  # steps in flight at once under overlap scheduling: at most two


class PinnedRing:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * RING_BUFFERS
        self._events: list[torch.cuda.Event | None] = [None] * RING_BUFFERS
        self._next = 0

    def stage(self, parts: Sequence[np.ndarray]) -> torch.Tensor:
        """`parts` concatenated as int32 in host memory: the next pinned buffer on CUDA (copy
        from it, then call sent()), a fresh tensor otherwise."""
        total = sum(int(p.size) for p in parts)
        if not self.pinned:
            out = torch.empty(total, dtype=torch.int32)
        else:
            i = self._next
            if self._events[i] is not None:
                self._events[i].synchronize()  # the copy that read it last is done
                self._events[i] = None
            buf = self._buffers[i]
            if buf is None or buf.numel() < total:
                buf = self._buffers[i] = torch.empty(max(1 << 12, 1 << (total - 1).bit_length()),
                                                     dtype=torch.int32, pin_memory=True)
            out = buf[:total]
        if parts:
            np.concatenate(parts, out=out.numpy(), casting="same_kind")
        return out

    def sent(self) -> None:
        """The copies from stage()'s buffer are queued: it may be reused once they have run."""
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._next] = event
            self._next = (self._next + 1) % RING_BUFFERS

    def upload(self, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """`parts` as int32 tensors on the device, through one copy."""
        host = self.stage(parts)
        flat = host.to(self.device, non_blocking=True)
        self.sent()
        return list(flat.split([int(p.size) for p in parts]))
