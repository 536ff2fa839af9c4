"""Who owns which KV: each request's table row, its slots, and its lock on the radix tree.

Every path that gives a request KV or takes it back goes through here, so one class keeps the
invariant free + evictable + protected + held by requests == capacity (Scheduler.kv_stats).
"""

from __future__ import annotations

import numpy as np

from ...radix import RadixCache
from .kv_memory import PageAllocator, ReqToTokenTable
from .kv_tiers import CacheTiers
from .sessions import Sessions
from ..core.request import Req


class RequestKV:
    def __init__(self, allocator: PageAllocator, req_table: ReqToTokenTable, tree: RadixCache, page_size: int,
                 tiers: CacheTiers | None = None, adapter_slots=None, sessions: Sessions | None = None):
        self.allocator = allocator
        self.req_table = req_table
        self.tree = tree
        self.page_size = page_size
        self.tiers = tiers  # the host and disk tiers (kv_tiers.py), with --enable-hierarchical-cache
        self.adapter_slots = adapter_slots  # LoRA device slots (srt/lora/slots.py), with --enable-lora
        self.sessions = sessions  # program sessions' protected prefixes (sessions.py)

    def admit(self, req: Req) -> bool:
        """Takes a table row and locks the longest cached prefix."""
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        key_len = req.seq_len - 1  # at least one token is computed, to get its logits
        if req.wants_input_logprobs and not req.output_ids:
            key_len = min(key_len, max(0, req.logprob.logprob_start_len - 1))
        key = req.fill_ids[:key_len]
        if self.tiers is None:
            match = self.tree.match_prefix(key, namespace=req.namespace)
            self.tree.lock(match.node)
            host = storage = 0
        else:  # the prefix's host and disk parts are loaded back now, before its prefill
            match = self.tree.match(key, namespace=req.namespace)
            self.tree.lock(match.node)
            try:
                match, host, storage = self.tiers.extend(key, req.namespace, match, req.seq_len, req.rid)
            except BaseException:  # extend let go of its lock and slots; the row goes too
                self.req_table.free(row)
                req.req_pool_idx = None
                raise
        req.last_node = match.node
        req.kv_len = req.cached_len = match.matched_len
        if not req.output_ids:
            req.cached_tokens = match.matched_len
            if self.tiers is not None:
                req.cached_tiers = (match.matched_len - host - storage, host, storage)
        if match.matched_len:
            self.req_table.write(row, 0, match.slot_indices)
        return True

    def make_room(self, needed: int, release_sessions: bool = False) -> bool:
        """Whether `needed` slots are free, evicting from the tree when short; `release_sessions`:
        then letting go of sessions' protected prefixes too, newest first (for work that cannot
        wait for memory, as nothing running would free any: protection never refuses work)."""
        if needed > self.allocator.available_size:
            self.tree.evict(needed - self.allocator.available_size)
            while (release_sessions and self.sessions is not None and needed > self.allocator.available_size
                   and self.sessions.release_newest()):
                self.tree.evict(needed - self.allocator.available_size)
        return needed <= self.allocator.available_size

    def alloc(self, req: Req, new_len: int, reserve: int = 0, release_sessions: bool = False) -> list[int] | None:
        """KV slots for `new_len` more tokens of `req` (keeping `reserve` free), making room
        (make_room). None, taking nothing, when they do not fit."""
        if not self.make_room(self.allocator.slots_needed(req.kv_len, new_len) + reserve, release_sessions):
            return None
        last = int(self.req_table.table[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else None
        slots = self.allocator.alloc(req.kv_len, new_len, last)
        if slots is not None:
            self.req_table.write(req.req_pool_idx, req.kv_len, slots)
            req.alloc_len = req.kv_len + new_len
        return slots

    def alloc_one_each(self, reqs: list[Req]) -> list[int]:
        """A slot for each request's next token, in one allocator call and one table write
        (per-request calls cost ~30 us each: 7 ms a step at 256 requests)."""
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        cols = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))
        table = self.req_table.table
        last = table[rows, cols - 1].tolist() if self.page_size > 1 else None
        slots = self.allocator.alloc_one_each(cols.tolist(), last)
        if slots is None:
            raise RuntimeError("the KV pool cannot hold one request; raise --max-total-tokens")
        self.req_table.write_each(rows, cols, slots)
        for req in reqs:
            req.alloc_len = req.kv_len + 1
        return slots

    def alloc_more(self, req: Req, new_len: int) -> list[int] | None:
        """Slots for `new_len` tokens after those already allocated (speculative drafts), from
        free memory only: None, taking nothing, when it is short (drafts are never worth an
        eviction)."""
        if self.allocator.slots_needed(req.alloc_len, new_len) > self.allocator.available_size:
            return None
        row = req.req_pool_idx
        last = int(self.req_table.table[row, req.alloc_len - 1]) if req.alloc_len else None
        slots = self.allocator.alloc(req.alloc_len, new_len, last)
        if slots is not None:
            self.req_table.write(row, req.alloc_len, slots)
            req.alloc_len += new_len
        return slots

    def truncate(self, req: Req) -> None:
        """Frees the slots allocated past kv_len (rejected drafts), whole pages only: the rest of
        the last page stays the request's, where its next tokens go."""
        keep = -(-req.kv_len // self.page_size) * self.page_size
        if req.alloc_len > keep:
            self.allocator.free(self.req_table.table[req.req_pool_idx, keep:req.alloc_len].tolist())
        req.alloc_len = req.kv_len

    def cache_unfinished(self, req: Req) -> None:
        """Inserts a running request's computed tokens into the tree and locks them, so they
        are shared before it finishes; its table row then points at the tree's slots."""
        row = req.req_pool_idx
        key = req.fill_ids[:req.kv_len]
        slots = self.req_table.table[row, :req.kv_len].tolist()
        already = self.tree.insert(key, slots, namespace=req.namespace)
        self.allocator.free(slots[req.cached_len:already])
        match = self.tree.match_prefix(key, namespace=req.namespace, record_stats=False)
        self.tree.unlock(req.last_node)
        self.tree.lock(match.node)
        req.last_node = match.node
        req.cached_len = match.matched_len
        self.req_table.write(row, 0, match.slot_indices)

    def release(self, req: Req, retracting: bool = False) -> None:
        """Gives a request's KV back: its computed sequence goes into the tree (unless aborted,
        or retracted without the host tier), its own slots are freed, the lock and table row
        are released. With the host tier a retracted request's KV is cached like a finished
        one's: the eviction that makes the room it was retracted for moves it to the host, and
        it resumes from there instead of prefilling its prompt and output again."""
        if self.adapter_slots is not None:  # its adapter's slot may go to another adapter now
            self.adapter_slots.release(req)
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        # Up to alloc_len: a forward that failed may have taken slots it never filled.
        slots = self.req_table.table[row, :max(req.kv_len, req.alloc_len)].tolist()
        adopted = req.cached_len
        finished = req.finish_reason is not None and req.finish_reason.type != "abort"
        if (finished and not retracting) or (retracting and self.tiers is not None):
            if self.tiers is not None and not retracting:
                self.tiers.save(req.fill_ids[:req.kv_len], req.namespace, slots[:req.kv_len])
            already = self.tree.insert(req.fill_ids[:req.kv_len], slots[:req.kv_len], namespace=req.namespace)
            self.allocator.free(slots[req.cached_len:already])
            adopted = max(already, self._aligned(req.kv_len) if not self.tree.disable else 0)
            if finished and req.session_id is not None and self.sessions is not None:
                self.sessions.keep(req.session_id, req.namespace, req.fill_ids[:req.kv_len])
        self.allocator.free(slots[adopted:])
        self.tree.unlock(req.last_node)
        self.req_table.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.cached_len = req.alloc_len = 0

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size
