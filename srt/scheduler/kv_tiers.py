"""The scheduler's side of the hierarchical cache: loading a request's prefix back from the
host and disk tiers at admission, saving finished prefixes to disk, and the per-tier counts.

The tree (radix/tiered.py) decides where KV lives and queues the host copies; this class runs
them on the engine (`engine.move_kv`) when the next step is launched (a disk read runs them
first: it writes slots a queued demotion may still have to read), and talks to the disk tier
(radix/storage.py) in blocks of `block_tokens` tokens keyed by a hash chain over the tokens,
the model's identity and the cache namespace. A request's disk blocks are read while it waits
(storage_prefetch.py) and written into device slots at its admission.
"""

from __future__ import annotations

import logging
import time

from ...radix.storage import KVStorage
from ...radix.tiered import TieredMatch, TieredRadixCache
from .kv_memory import PageAllocator
from .storage_prefetch import PREFETCH_MAX_BYTES, StoragePrefetch

logger = logging.getLogger(__name__)

STORAGE_BLOCK_TOKENS = 64
STORAGE_ROUND_BYTES = 256 << 20  # disk blocks read per round (the engine's staging buffer)
# A load defers the host tier's background pinning (host_segments.PinningGate) for the time it
# would take at LOAD_BYTES_PER_S, plus LOAD_DEFER_S.
LOAD_BYTES_PER_S = 10e9
LOAD_DEFER_S = 0.05


class CacheTiers:
    def __init__(self, tree: TieredRadixCache, allocator: PageAllocator, engine, storage: KVStorage | None,
                 block_tokens: int, prefetch: StoragePrefetch | None = None):
        self.tree = tree
        self.allocator = allocator
        self.engine = engine
        self.storage = storage
        self.prefetch = prefetch
        self.block_tokens = block_tokens
        self.bytes_per_token = engine.kv_bytes_per_token
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"host_hit_tokens": 0, "host_miss_tokens": 0, "storage_hit_tokens": 0,
                      "storage_read_seconds": 0.0, "storage_saved_tokens": 0}

    # ---- copies --------------------------------------------------------------------------

    def flush_moves(self) -> None:
        """Runs the tree's queued copies now (before the next forward writes or reads)."""
        moves = self.tree.take_moves()
        if moves:
            self.engine.move_kv(moves)

    def _alloc(self, n: int) -> list[int] | None:
        """`n` fresh device slots (whole pages: callers pass page-aligned counts), evicting."""
        needed = self.allocator.slots_needed(0, n)
        if needed > self.allocator.available_size:
            self.tree.evict(needed - self.allocator.available_size)
        return self.allocator.alloc(0, n, None)

    # ---- admission -----------------------------------------------------------------------

    def extend(self, key: list[int], namespace, match: TieredMatch, seq_len: int,
               rid: str) -> tuple[TieredMatch, int, int]:
        """`match` (locked by the caller) extended over the host part and then over disk
        blocks; moves the lock to the returned match's node. Returns it with the tokens that
        came from the host and from disk. Nothing is loaded for a request of `seq_len` tokens
        that could not fit in the device pool now (it waits; loading would be thrown away).
        On an exception (a failed copy) the lock is released and nothing is kept."""
        host = storage = 0
        room = self.allocator.available_size + self.tree.evictable_size
        if seq_len - match.matched_len > room:  # it waits; its prefetch goes on
            self.stats["host_miss_tokens"] += match.host_len
            return match, 0, 0
        try:
            if match.host_nodes:
                self._defer_pinning(match.host_len)
                loaded = self.tree.load_back(match, self._alloc)
                if loaded is not match:
                    host = loaded.matched_len - match.matched_len
                    self._relock(match, loaded)
                    match = loaded
                else:
                    self.stats["host_miss_tokens"] += match.host_len
            if self.storage is not None:
                match, storage = self._from_storage(key, namespace, match, rid)
        except BaseException:
            self.tree.unlock(match.node)  # the caller's lock, or where it moved
            self.forget(rid)
            raise
        # The copies stay queued until the step is launched: the load-backs of every request
        # admitted into it then run as one batch, layer by layer, beside the prefill.
        self.stats["host_hit_tokens"] += host
        return match, host, storage

    def _defer_pinning(self, tokens: int) -> None:
        self.engine.defer_host_pinning(LOAD_DEFER_S + tokens * self.bytes_per_token / LOAD_BYTES_PER_S)

    def _relock(self, old: TieredMatch, new: TieredMatch) -> None:
        self.tree.lock(new.node)
        self.tree.unlock(old.node)

    def _from_storage(self, key: list[int], namespace, match: TieredMatch, rid: str) -> tuple[TieredMatch, int]:
        """Extends `match` over the disk blocks that follow it: those the request's prefetch
        reads (storage_prefetch.py), uploaded as they arrive, or, without one, read now, a
        staging buffer's worth at a time; each round written into fresh device slots, until
        the first miss."""
        b = self.block_tokens
        have = match.matched_len
        if match.host_nodes or have + b > len(key):  # host part not loaded: no room on the device
            self.forget(rid)
            return match, 0
        start = time.perf_counter()
        keys = self.storage.block_keys(key[:len(key) // b * b], namespace)
        block_bytes = b * self.bytes_per_token
        per_round = max(1, STORAGE_ROUND_BYTES // block_bytes)
        first = i = have // b
        skip = have - i * b  # tokens of the first block already on the device
        claim = self.prefetch.claim(rid, first) if self.prefetch is not None else None
        slots: list[int] = []
        new = None
        try:
            while i < len(keys):
                batch = keys[i:i + per_round]
                self._defer_pinning(len(batch) * b)
                if claim is None:  # read into the engine's (pinned) staging buffer
                    source, offset = None, 0
                    found = self.storage.get_many_into(batch, self.engine.kv_staging(len(batch) * block_bytes))
                else:  # uploaded from the prefetch's buffer as it is
                    source, offset = claim.data, (i - first) * block_bytes
                    found = min(len(batch), claim.ready(i - first, len(batch)))
                new = self._alloc(found * b - skip) if found else None
                if new is None:
                    break
                self.flush_moves()  # eviction's copies read slots this write may reuse
                self.engine.upload_kv_tokens(new, offset + skip * self.bytes_per_token, source)
                slots += new
                new = None
                i, skip = i + found, 0
                if claim is None and found < len(batch):
                    break
        except BaseException:  # the slots taken are not in the tree yet: give them back
            self.allocator.free(slots + (new or []))
            raise
        finally:
            if claim is not None:
                self.prefetch.release(rid, claim, i - first)
        if not slots:
            return match, 0
        end = have + len(slots)
        self.tree.insert(key[:end], match.slot_indices + slots, namespace)
        new_match = self.tree.match(key[:end], namespace, record_stats=False)
        self._relock(match, new_match)
        self.stats["storage_hit_tokens"] += len(slots)
        self.stats["storage_read_seconds"] += time.perf_counter() - start
        return new_match, len(slots)

    def prefetch_for(self, rid: str, key: list[int], namespace) -> None:
        """Starts reading the disk blocks of a new request's prompt beyond what the device and
        host tiers hold, in the background (storage_prefetch.py)."""
        if self.prefetch is None or not key:
            return
        b = self.block_tokens
        keys = self.storage.block_keys(key[:len(key) // b * b], namespace)
        first = self.tree.cached_prefix_len(key, namespace) // b
        if first < len(keys) and self.storage.contains(keys[first]):  # a load is coming
            self._defer_pinning((len(keys) - first) * b)
        self.prefetch.start(rid, keys, first)

    def forget(self, rid: str) -> None:
        """A request's prefetch is no longer wanted (it was aborted, or admitted without it)."""
        if self.prefetch is not None:
            self.prefetch.forget(rid)

    # ---- saving --------------------------------------------------------------------------

    def save(self, key: list[int], namespace, slots: list[int]) -> None:
        """Queues the whole blocks of a finished sequence that the disk tier lacks (its KV is
        read from the device now, before the slots can be reused)."""
        if self.storage is None or not self.storage.writes_enabled:
            return
        b = self.block_tokens
        keys = self.storage.block_keys(key[:len(key) // b * b], namespace)
        missing = [i for i, k in enumerate(keys) if not self.storage.contains(k)]
        if not missing:
            return
        data = self.engine.read_kv_tokens([s for i in missing for s in slots[i * b:(i + 1) * b]])
        size = b * self.bytes_per_token
        for n, i in enumerate(missing):  # slices of a fresh buffer nobody else holds: no copies
            self.storage.put(keys[i], data[n * size:(n + 1) * size], owned=True)
        self.stats["storage_saved_tokens"] += len(missing) * b

    def close(self) -> None:
        """Lets the disk tier's queued writes land and stops the host pool's pinning."""
        if self.prefetch is not None:
            self.prefetch.close()
        if self.storage is not None:
            self.storage.close()
        self.engine.close_host_kv()

    # ---- visibility ----------------------------------------------------------------------

    def flush(self, include_storage: bool) -> int:
        """After the tree's reset: drops the disk tier's blocks too when asked; returns how many."""
        self.reset_stats()
        return self.storage.clear() if include_storage and self.storage is not None else 0

    def info(self) -> dict:
        tree = self.tree
        engine_stats = self.engine.host_kv_stats()
        bpt = self.bytes_per_token
        host = {"capacity_tokens": tree.host.capacity, "used_tokens": tree.host_used,
                "capacity_bytes": tree.host.capacity * bpt, "allocated_bytes": engine_stats["allocated_bytes"],
                "hit_tokens": self.stats["host_hit_tokens"], "miss_tokens": self.stats["host_miss_tokens"],
                "demoted_tokens": tree.demoted_tokens, "dropped_tokens": tree.dropped_tokens,
                "loaded_tokens": engine_stats["h2d_tokens"], "loaded_bytes": engine_stats["h2d_tokens"] * bpt,
                "load_seconds": engine_stats["h2d_seconds"], "written_bytes": engine_stats["d2h_tokens"] * bpt,
                "write_seconds": engine_stats["d2h_seconds"], "pin_wait_seconds": engine_stats["pin_wait_seconds"],
                "write_policy": tree.write_policy}
        out = {"host": host}
        if self.storage is not None:
            stats = self.storage.stats
            out["storage"] = {**stats, "block_tokens": self.block_tokens, "used_tokens": stats["files"] * self.block_tokens,
                              "hit_tokens": self.stats["storage_hit_tokens"],
                              "saved_tokens": self.stats["storage_saved_tokens"],
                              "read_seconds": self.stats["storage_read_seconds"],
                              "prefetch_policy": self.prefetch.policy,
                              "prefetched_blocks": self.prefetch.stats["prefetched_blocks"],
                              "prefetch_skipped_requests": self.prefetch.stats["skipped_requests"],
                              "prefetch_wait_seconds": self.prefetch.stats["wait_seconds"],
                              "directory": str(self.storage.directory)}
        return out


def storage_block_tokens(page_size: int) -> int:
    """Disk blocks hold whole pages: 64 tokens, or one page when pages are larger."""
    return STORAGE_BLOCK_TOKENS if STORAGE_BLOCK_TOKENS % page_size == 0 else page_size * -(-STORAGE_BLOCK_TOKENS // page_size)


def host_tier_request(args, device_tokens: int) -> dict[str, int]:
    """What the engine is asked to allocate for the host tier: --hicache-size GB, or
    --hicache-ratio times the device pool."""
    if args.cache.hicache_size:
        return {"host_kv_bytes": int(args.cache.hicache_size * 2**30)}
    return {"host_kv_tokens": int(args.cache.hicache_ratio * device_tokens)}


def refuse_unsupported_with_tiers(args) -> None:
    """What the tiers do not cover yet is refused by name, not run without them."""
    if args.parallel.tp_size > 1 and args.cache.hicache_storage_backend is not None:
        raise ValueError(f"hicache_storage_backend: not implemented with tp_size {args.parallel.tp_size} "
                         "(each rank's shard would need its own files, read at admission on rank 0); the host "
                         "tier works")
    if args.speculative.speculative_algorithm == "draft":
        raise ValueError("enable_hierarchical_cache: not implemented with speculative_algorithm draft (the draft "
                         "model's KV pool has no host tier); ngram speculation works")


def make_storage(args, engine, block_tokens: int) -> tuple[KVStorage | None, StoragePrefetch | None]:
    """The disk tier and its prefetcher, with --hicache-storage-backend."""
    cache = args.cache
    if cache.hicache_storage_backend is None:
        return None, None
    max_bytes = int(cache.hicache_storage_max_gb * 2**30) or None
    storage = KVStorage(cache.hicache_storage_dir, engine.kv_identity, block_tokens,
                        block_tokens * engine.kv_bytes_per_token, max_bytes)
    buffer = engine.kv_prefetch_buffer(PREFETCH_MAX_BYTES)
    buffer()  # pinned before the server says it is ready: a first request must not wait for it
    return storage, StoragePrefetch(storage, cache.hicache_storage_prefetch_policy,
                                    cache.hicache_storage_prefetch_timeout, buffer, engine.wait_kv_uploads)

