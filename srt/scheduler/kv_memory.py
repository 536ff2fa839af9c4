"""Paged KV bookkeeping on the host: which slots are free, and which slots each request's
tokens use. No torch: the scheduling policy owns these, the device engine only reads the table.

A *slot* is the index of one token's K/V in the pool. Slots come in pages of `page_size`
consecutive slots (page p owns slots [p * page_size, (p + 1) * page_size)); a request's tokens
fill its pages in order, so a page is owned by exactly one request or one radix-tree node.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..core.step import kv_pool_slots


class ReqToTokenTable:
    """Row r maps request r's token positions to KV slots: `table[r, pos] = slot`.

    A host numpy array whatever the device: the policy writes a few entries per request every
    step, and on a GPU each write to a device table would be a synchronizing copy (at 500
    running requests that was ~12 ms a decode step). The device engine views the same memory
    as a torch tensor (`torch.from_numpy`), and attention backends turn a batch's rows into
    page tables once per forward.
    """

    def __init__(self, max_reqs: int, max_context_len: int):
        self.table = np.zeros((max_reqs, max_context_len), dtype=np.int64)
        # Per row, the first position written since tensor parallelism's rank 0 last sent the
        # row to the other ranks (executor/step_broadcast.py); rows are dirty from 0 at first.
        self.dirty_from = np.zeros(max_reqs, dtype=np.int64)
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def write(self, row: int, start: int, slots) -> None:
        """table[row, start:start + len(slots)] = slots. Every write goes through here or
        `write_each`, so the dirty marks are exact."""
        self.table[row, start:start + len(slots)] = slots
        self.dirty_from[row] = min(self.dirty_from[row], start)

    def write_each(self, rows: np.ndarray, cols: np.ndarray, slots) -> None:
        """table[rows[i], cols[i]] = slots[i] for distinct rows."""
        self.table[rows, cols] = slots
        self.dirty_from[rows] = np.minimum(self.dirty_from[rows], cols)

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)


class PageAllocator:
    """Hands out KV slots a page at a time. Page 0 is reserved as a padding target.

    Invariant: every page is in exactly one of {free list, some owner's slot list}.
    """

    def __init__(self, capacity_tokens: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = kv_pool_slots(capacity_tokens, page_size) // page_size  # page 0: the padding page
        self._free_pages = list(range(self.num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Usable token slots (the padding page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def slots_needed(self, seq_len: int, new_len: int) -> int:
        """Fresh slots that `alloc(seq_len, new_len, ...)` will take (whole pages)."""
        room_in_last_page = (-seq_len) % self.page_size
        return -(-max(0, new_len - room_in_last_page) // self.page_size) * self.page_size

    def alloc(self, seq_len: int, new_len: int, last_slot: int | None) -> list[int] | None:
        """Slots for tokens [seq_len, seq_len + new_len) of a request whose last slot is `last_slot`.

        The rest of the request's partly filled last page is used first. Returns None (and
        takes nothing) when not enough pages are free.
        """
        ps = self.page_size
        room = (-seq_len) % ps
        if room and last_slot is None:
            raise ValueError("a partly filled last page needs last_slot")
        num_pages = -(-max(0, new_len - room) // ps)
        if num_pages > len(self._free_pages):
            return None
        slots = list(range(last_slot + 1, last_slot + 1 + min(room, new_len))) if room else []
        pages = self._take_pages(num_pages)
        slots.extend(pages if ps == 1 else chain.from_iterable(range(p * ps, (p + 1) * ps) for p in pages))
        return slots[:new_len]

    def _take_pages(self, count: int) -> list[int]:
        """`count` free pages in the order repeated pops would give, taken in one slice (a long
        prompt takes thousands)."""
        free = self._free_pages
        taken = free[len(free) - count:] if count else []
        del free[len(free) - count:]
        taken.reverse()
        return taken

    def alloc_one_each(self, seq_lens: list[int], last_slots: list[int] | None) -> list[int] | None:
        """One slot for each of several requests (a decode step): the next slot of a request's
        last page, or the first of a fresh page. `last_slots` may be None when page_size is 1.
        Returns None (and takes nothing) when not enough pages are free."""
        ps = self.page_size
        free = self._free_pages
        if ps == 1:
            if len(seq_lens) > len(free):
                return None
            return self._take_pages(len(seq_lens))
        if sum(1 for n in seq_lens if n % ps == 0) > len(free):
            return None
        return [last + 1 if n % ps else free.pop() * ps for n, last in zip(seq_lens, last_slots)]

    def free(self, slots: list[int]) -> None:
        """Frees the pages holding `slots` (a caller frees a page once, with any of its slots)."""
        if not slots:
            return
        ps = self.page_size
        if ps == 1:
            self._free_pages.extend(slots)
            return
        self._free_pages.extend(dict.fromkeys(s // ps for s in slots))

    def reset(self) -> None:
        self._free_pages = list(range(self.num_pages - 1, 0, -1))
