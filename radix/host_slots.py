"""The host tier's slot indices (radix/tiered.py hands them out to nodes demoted from the device)."""

from __future__ import annotations

from collections.abc import Sequence


class HostSlots:
    """Host-pool slot indices: a free list handing out the lowest indices first, so a fresh
    pool gives contiguous runs (one large copy per run)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        taken.reverse()
        return taken

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def reset(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))
