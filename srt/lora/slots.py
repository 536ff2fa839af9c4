"""The scheduling policy's view of the adapters (no torch): which adapter names are loaded
(each by the digest of its files), which one each of the `--max-loras-per-batch` device slots
holds, and which running requests pin them.

A request takes its adapter's slot when it is admitted and lets go when its KV is released
(finished, aborted, retracted). A slot no running request pins may be given to another adapter
(least recently used first); the engine copies that adapter in before the step that needs it
(`take_loads`). Since running requests pin their slots, a batch never holds more adapters than
there are slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..core.request import Req


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    uid: str  # digest of its files: the cache namespace and the engine's key


class AdapterSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.adapters: dict[str, LoadedAdapter] = {}  # by name
        self.holder: list[str | None] = [None] * num_slots  # uid in each slot
        self.pins = [0] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # oldest first
        self._loads: list[tuple[int, str]] = []
        self.slot_loads = 0  # adapters copied into a slot so far

    def register(self, adapter: LoadedAdapter) -> None:
        self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> LoadedAdapter | None:
        """Forgets `name`; its slot is freed unless another loaded name has the same files."""
        adapter = self.adapters.pop(name, None)
        if adapter is not None and not self.uid_in_use(adapter.uid):
            for slot, uid in enumerate(self.holder):
                if uid == adapter.uid and not self.pins[slot]:
                    self.holder[slot] = None
            # A copy queued for a request that was not admitted after all: its tensors go now.
            self._loads = [(s, u) for s, u in self._loads if u != adapter.uid]
        return adapter

    def uid_in_use(self, uid: str) -> bool:
        return any(a.uid == uid for a in self.adapters.values())

    def acquire(self, req: Req) -> bool:
        """Pins a slot holding `req`'s adapter (loading it into a free or idle slot if needed);
        False when every slot is pinned by other adapters' requests (the request waits)."""
        if req.adapter_uid is None or req.adapter_slot is not None:
            return True
        uid = req.adapter_uid
        slot = self.holder.index(uid) if uid in self.holder else self._free_slot()
        if slot is None:
            return False
        if self.holder[slot] != uid:
            self.holder[slot] = uid
            self._loads = [(s, u) for s, u in self._loads if s != slot] + [(slot, uid)]
        self.pins[slot] += 1
        self._lru.move_to_end(slot)
        req.adapter_slot = slot
        return True

    def release(self, req: Req) -> None:
        if req.adapter_slot is not None:
            self.pins[req.adapter_slot] -= 1
            req.adapter_slot = None

    def take_loads(self) -> list[tuple[int, str]]:
        """(slot, uid) copies the next step needs first."""
        loads, self._loads = self._loads, []
        self.slot_loads += len(loads)
        return loads

    def _free_slot(self) -> int | None:
        for slot in self._lru:  # an empty slot, else the least recently used unpinned one
            if self.holder[slot] is None:
                return slot
        return next((slot for slot in self._lru if not self.pins[slot]), None)

    def info(self) -> dict:
        return {"loaded": sorted(self.adapters), "slots": self.num_slots,
                "resident": [next((a.name for a in self.adapters.values() if a.uid == uid), None)
                             for uid in self.holder],
                "pinned_slots": sum(1 for p in self.pins if p), "slot_loads": self.slot_loads}
