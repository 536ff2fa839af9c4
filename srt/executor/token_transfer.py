"""Sampled token ids on their way to the host.

With overlap scheduling the scheduler launches step N+1 before it commits step N's tokens, so
the device-to-host copy of each step's ids is queued right behind its sampling, into pinned
memory, and waited for only when the tokens are needed. A plain `.tolist()` at that point
would queue the copy behind step N+1 and wait for that whole step.
"""

from __future__ import annotations

from typing import Callable

import torch


class TokenTransfer:
    """Starts device-to-host copies of sampled ids behind the work that produces them.

    Two pinned buffers alternate: a step's tokens are always read before the step after the
    next one is sampled, so a buffer is never overwritten while its copy is pending or unread.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def start(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        if self.device.type != "cuda":
            return ids.tolist
        count = ids.numel()
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < count:
            buf = self._buffers[self._turn] = torch.empty(max(count, 256), dtype=torch.int64, pin_memory=True)
        self._turn ^= 1
        host = buf[:count]
        host.copy_(ids, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()

        def tokens() -> list[int]:
            arrived.synchronize()
            return host.tolist()

        return tokens
