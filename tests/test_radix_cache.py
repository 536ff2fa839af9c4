"""RadixCache: unit tests for each operation, and a hypothesis state machine that checks the
tree against a brute-force reference under random insert/match/lock/unlock/evict/reset."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.radix import MatchResult, RadixCache, TreeNode, common_prefix_len
from radixlm.radix.debug import format_tree


class FakePool:
    """A free list of `capacity` slots, as the scheduler's allocator would keep."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = list(range(capacity - 1, -1, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        assert len(set(slots)) == len(slots), "double free"
        assert not set(self.free).intersection(slots), "double free"
        self.free.extend(slots)


def make_cache(capacity: int = 64, page_size: int = 1, disable: bool = False
               ) -> tuple[RadixCache, FakePool]:
    pool = FakePool(capacity)
    return RadixCache(capacity, pool.release, page_size=page_size, disable=disable), pool


def insert_fresh(cache: RadixCache, pool: FakePool, key: list[int],
                 namespace: Hashable = None) -> int:
    """Caller protocol for a key whose slots were all freshly allocated."""
    slots = pool.alloc(len(key))
    assert slots is not None
    cached = cache.insert(key, slots, namespace)
    aligned = len(key) - len(key) % cache.page_size
    pool.release(slots[:cached] + slots[aligned:])  # duplicates and the partial page
    return cached


def check_accounting(cache: RadixCache, pool: FakePool) -> None:
    cache.check_invariants()
    assert len(pool.free) + cache.evictable_size + cache.protected_size == pool.capacity


# ---------------------------------------------------------------------------- unit tests
def test_insert_then_match_returns_slots() -> None:
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3], [7, 8, 9]) == 0
    result = cache.match_prefix([1, 2, 3, 4])
    assert isinstance(result, MatchResult) and isinstance(result.node, TreeNode)
    assert result.slot_indices == [7, 8, 9] and result.matched_len == 3
    assert cache.match_prefix((1, 2)).slot_indices == [7, 8]  # tuples work as keys too
    assert cache.match_prefix([5]).matched_len == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_cached_prefix_len_is_a_read_only_match(page_size: int) -> None:
    cache, pool = make_cache(page_size=page_size)
    insert_fresh(cache, pool, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, pool, [1, 2, 3, 9, 9, 9], namespace="salt")
    before = (cache.stats, cache.node_count())
    for key, ns in (([1, 2, 3, 4, 7], None), ([1, 2, 3, 9, 9, 9, 1], "salt"), ([8], None), ([1, 2], "other")):
        got = cache.cached_prefix_len(key, ns)
        assert (cache.stats, cache.node_count()) == before  # no split, no statistics
        assert got == cache.match_prefix(key, ns).matched_len
        cache.reset_stats()
        before = (cache.stats, cache.node_count())


def test_match_inside_node_splits_it() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3, 4, 5])
    result = cache.match_prefix([1, 2, 3, 9])
    assert result.matched_len == 3 and result.node.key == [1, 2, 3]
    assert [c.key for c in result.node.children.values()] == [[4, 5]]
    check_accounting(cache, pool)


def test_insert_returns_cached_length_and_adopts_the_rest() -> None:
    cache, pool = make_cache()
    assert insert_fresh(cache, pool, [1, 2, 3, 4]) == 0
    assert insert_fresh(cache, pool, [1, 2, 3, 4]) == 4
    assert insert_fresh(cache, pool, [1, 2, 7, 8, 9]) == 2
    assert insert_fresh(cache, pool, [1, 2]) == 2
    assert cache.total_size == 7 and cache.evictable_size == 7
    check_accounting(cache, pool)


def test_page_size_truncates_to_whole_pages() -> None:
    cache, pool = make_cache(page_size=4)
    assert insert_fresh(cache, pool, list(range(10))) == 0  # 8 tokens adopted, 2 handed back
    assert cache.total_size == 8
    assert cache.match_prefix(list(range(10))).matched_len == 8
    assert cache.match_prefix([0, 1, 2]).matched_len == 0
    # Diverging at token 6 shares only the first whole page.
    result = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])
    assert result.matched_len == 4 and result.node.key == [0, 1, 2, 3]
    assert insert_fresh(cache, pool, [0, 1, 2, 3, 4, 5, 99, 99, 5]) == 4
    check_accounting(cache, pool)


def test_namespaces_are_isolated() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-b").matched_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="lora-a").matched_len == 3
    assert insert_fresh(cache, pool, [1, 2, 3]) == 0
    assert cache.evict(100) == 6 and cache.total_size == 0
    assert "lora-a" not in format_tree(cache)  # emptied namespaces are dropped
    check_accounting(cache, pool)


def test_lock_prevents_eviction() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3, 4])
    insert_fresh(cache, pool, [1, 2, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (4, 2)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4]).matched_len == 4
    cache.lock(node)  # locks nest
    cache.unlock(node)
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)
    assert cache.evict(4) == 4 and cache.total_size == 0
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)
    check_accounting(cache, pool)


def test_split_of_a_locked_node_keeps_both_halves_locked() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    insert_fresh(cache, pool, [1, 2, 9])  # splits the locked node after [1, 2]
    assert node.key == [3, 4] and node.parent is not None and node.parent.lock_ref == 1
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    assert cache.evict(10) == 1
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)
    check_accounting(cache, pool)


def test_eviction_is_lru_and_frees_parents_that_become_leaves() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 1])
    insert_fresh(cache, pool, [2, 2])
    insert_fresh(cache, pool, [1, 1, 3, 3])
    cache.match_prefix([2, 2])  # [2, 2] is now newer than [1, 1] and [1, 1, 3, 3]
    assert cache.evict(1) == 2  # whole nodes go: leaf [3, 3], the oldest
    assert cache.match_prefix([1, 1, 3, 3]).matched_len == 2
    cache.match_prefix([2, 2])
    # [1, 1] became a leaf once [3, 3] went; it is older than [2, 2], so it goes first.
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).matched_len == 0
    assert cache.match_prefix([2, 2]).matched_len == 2
    assert cache.stats["evicted_tokens"] == 4
    check_accounting(cache, pool)


def test_match_ending_inside_a_node_refreshes_only_the_matched_part() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 1, 2, 2])
    insert_fresh(cache, pool, [5, 5])
    cache.match_prefix([1, 1, 9])  # splits; [1, 1] is now newer than [5, 5], [2, 2] older
    assert cache.evict(3) == 4  # [2, 2] first, then [5, 5] (older than the leaf [1, 1])
    assert cache.match_prefix([1, 1]).matched_len == 2


def test_disable_caches_nothing() -> None:
    cache, pool = make_cache(disable=True)
    slots = pool.alloc(3)
    assert slots is not None and cache.insert([1, 2, 3], slots) == 0
    pool.release(slots)  # disabled: the caller frees everything
    result = cache.match_prefix([1, 2, 3])
    assert result.matched_len == 0
    cache.lock(result.node)
    cache.unlock(result.node)
    assert cache.total_size == 0 and cache.evict(10) == 0
    check_accounting(cache, pool)


def test_reset_frees_everything_and_refuses_while_locked() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [4, 5], namespace="x")
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert cache.total_size == 5
    cache.unlock(node)
    cache.reset()
    assert cache.total_size == 0 and len(pool.free) == pool.capacity
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    assert cache.stats["queried_tokens"] == 3
    check_accounting(cache, pool)


def test_stats_count_queried_and_hit_tokens() -> None:
    cache, pool = make_cache()
    insert_fresh(cache, pool, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4])
    cache.match_prefix([1, 2, 9, 9])
    assert cache.stats == {"queried_tokens": 8, "hit_tokens": 6, "hit_rate": 0.75,
                           "evicted_tokens": 0}
    cache.reset_stats()
    assert cache.stats["hit_rate"] == 0.0


def test_bad_arguments_raise_named_errors() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(10, lambda s: None, page_size=0)
    cache, _ = make_cache()
    with pytest.raises(ValueError, match="slot_indices"):
        cache.insert([1, 2], [0])
    assert "namespace None" in format_tree(cache)


@given(st.lists(st.integers(0, 2), max_size=300), st.lists(st.integers(0, 1), max_size=200),
       st.lists(st.integers(0, 1), max_size=200), st.integers(0, 5))
def test_common_prefix_len_matches_a_plain_loop(shared: list[int], a_tail: list[int],
                                                b_tail: list[int], b_start: int) -> None:
    a, b = shared + a_tail, [7] * b_start + shared + b_tail
    expected = 0
    while expected < min(len(a), len(b) - b_start) and a[expected] == b[b_start + expected]:
        expected += 1
    assert common_prefix_len(a, b, b_start) == expected


# ---------------------------------------------------------------------------- state machine
# Long shared segments (one diverging from another at 25) exercise splits deep inside nodes.
_SEG = [list(range(100, 140)), list(range(100, 125)) + list(range(200, 215)), list(range(300, 340))]
_PART = st.one_of(st.sampled_from(_SEG), st.lists(st.integers(0, 3), min_size=1, max_size=5))
KEYS = st.lists(_PART, max_size=4).map(lambda parts: [t for p in parts for t in p])
NAMESPACES = st.sampled_from([None, None, "salt", 7])
CAPACITY = 200


@dataclass
class Request:
    namespace: Hashable
    key: list[int]
    prefix_slots: list[int]
    own_slots: list[int]  # allocated by the "scheduler" for key[len(prefix_slots):]
    node: TreeNode


class RadixMachine(RuleBasedStateMachine):
    """Reference: every cached page as (namespace, prefix tuple) -> (its slots, last tick)."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.pool = FakePool(CAPACITY)
        self.freed: list[int] = []
        self.cache = RadixCache(CAPACITY, self.freed.extend, page_size=page_size)
        self.pages: dict[tuple[Hashable, tuple[int, ...]], tuple[list[int], int]] = {}
        self.owner: dict[int, tuple[Hashable, tuple[int, ...]]] = {}
        self.locks: Counter[tuple[Hashable, tuple[int, ...]]] = Counter()
        self.requests: list[Request] = []
        self.clock = 0

    # -- reference helpers
    def _page_ids(self, ns: Hashable, key: list[int], end: int) -> list[tuple[Hashable, tuple]]:
        return [(ns, tuple(key[:p])) for p in range(self.ps, end + 1, self.ps)]

    def _longest(self, ns: Hashable, key: list[int]) -> tuple[int, list[int]]:
        length, slots = 0, []
        while length + self.ps <= len(key) and (ns, tuple(key[:length + self.ps])) in self.pages:
            length += self.ps
            slots += self.pages[(ns, tuple(key[:length]))][0]
        return length, slots

    def _touch(self, ns: Hashable, key: list[int], end: int) -> None:
        self.clock += 1
        for page in self._page_ids(ns, key, end):
            self.pages[page] = (self.pages[page][0], self.clock)

    def _adopt(self, ns: Hashable, key: list[int], slots: list[int], start: int) -> None:
        end = len(key) - len(key) % self.ps
        for p in range(start + self.ps, end + 1, self.ps):
            page = (ns, tuple(key[:p]))
            self.pages[page] = (slots[p - self.ps:p], 0)
            for s in slots[p - self.ps:p]:
                self.owner[s] = page
        self._touch(ns, key, end)

    def _evictable_leaf_ticks(self) -> list[int]:
        parents = {(ns, prefix[:-self.ps]) for ns, prefix in self.pages}
        return [tick for page, (_, tick) in self.pages.items()
                if page not in parents and not self.locks[page]]

    def _absorb_frees(self) -> list[tuple[Hashable, tuple]]:
        """Checks what the cache freed through its callback and drops it from the reference."""
        freed = self.freed[:]
        self.freed.clear()  # the cache holds this list's bound extend
        assert len(set(freed)) == len(freed)
        gone = {self.owner[s] for s in freed}  # KeyError: freed a slot the tree did not own
        for page in gone:
            assert not self.locks[page], "a locked slot was freed"
            assert set(self.pages[page][0]) <= set(freed), "part of a page was freed"
        for s in freed:
            del self.owner[s]
        for page in gone:
            del self.pages[page]
        for ns, prefix in self.pages:  # eviction only ever removes leaves
            assert len(prefix) == self.ps or (ns, prefix[:-self.ps]) in self.pages
        self.pool.release(freed)
        return list(gone)

    def _evict(self, num_tokens: int) -> int:
        before = self.cache.evictable_size
        ticks_of = {page: tick for page, (_, tick) in self.pages.items()}
        evicted = self.cache.evict(num_tokens)
        gone = self._absorb_frees()
        assert evicted == len(gone) * self.ps
        assert evicted >= min(max(num_tokens, 0), before)
        if gone:  # LRU: nothing evicted is newer than an evictable leaf that stayed
            newest_gone = max(ticks_of[p] for p in gone)
            assert newest_gone <= min(self._evictable_leaf_ticks(), default=newest_gone)
        return evicted

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.pool.free):
            self._evict(n - len(self.pool.free))
        return self.pool.alloc(n)

    def _match(self, ns: Hashable, key: list[int]) -> MatchResult:
        result = self.cache.match_prefix(key, ns)
        length, slots = self._longest(ns, key)
        assert result.matched_len == length and result.slot_indices == slots
        if length:
            self._touch(ns, key, length)
        return result

    # -- rules
    @rule(ns=NAMESPACES, key=KEYS)
    def insert(self, ns: Hashable, key: list[int]) -> None:
        slots = self._alloc(len(key))
        if slots is None:
            return
        cached = self.cache.insert(key, slots, ns)
        expected, _ = self._longest(ns, key)
        assert cached == expected
        aligned = len(key) - len(key) % self.ps
        self.pool.release(slots[:cached] + slots[aligned:])
        self._adopt(ns, key, slots, cached)

    @rule(ns=NAMESPACES, key=KEYS)
    def match(self, ns: Hashable, key: list[int]) -> None:
        self._match(ns, key)

    @rule(ns=NAMESPACES, key=KEYS)
    def start_request(self, ns: Hashable, key: list[int]) -> None:
        result = self._match(ns, key)
        self.cache.lock(result.node)
        self.locks.update(self._page_ids(ns, key, result.matched_len))
        own = self._alloc(len(key) - result.matched_len)
        if own is None:
            self._unlock(Request(ns, key, result.slot_indices, [], result.node))
            return
        self.requests.append(Request(ns, key, result.slot_indices, own, result.node))

    def _unlock(self, req: Request) -> None:
        self.cache.unlock(req.node)
        self.locks.subtract(self._page_ids(req.namespace, req.key, len(req.prefix_slots)))

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 1 << 16))
    def finish_request(self, pick: int) -> None:
        req = self.requests.pop(pick % len(self.requests))
        slots = req.prefix_slots + req.own_slots
        cached = self.cache.insert(req.key, slots, req.namespace)
        expected, _ = self._longest(req.namespace, req.key)
        assert cached == expected and cached >= len(req.prefix_slots)
        aligned = len(req.key) - len(req.key) % self.ps
        self.pool.release(slots[len(req.prefix_slots):cached] + slots[aligned:])
        self._adopt(req.namespace, req.key, slots, cached)
        self._unlock(req)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 1 << 16))
    def abort_request(self, pick: int) -> None:
        req = self.requests.pop(pick % len(self.requests))
        self.pool.release(req.own_slots)
        self._unlock(req)

    @rule(num_tokens=st.integers(-1, CAPACITY))
    def evict(self, num_tokens: int) -> None:
        self._evict(num_tokens)

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self._absorb_frees()
        assert not self.pages and len(self.pool.free) == CAPACITY

    @invariant()
    def tree_matches_reference(self) -> None:
        """Each node holds exactly the reference's pages, and orders LRU as the reference does."""
        by_tick: list[tuple[int, int]] = []  # (node.last_access, reference tick)
        for node in self.cache._iter_nodes():
            path, root = [], node
            while root.parent is not None:
                path.append(root.key)
                root = root.parent
            prefix = [t for key in reversed(path[1:]) for t in key]
            ticks = set()
            for i in range(0, len(node.key), self.ps):
                prefix += node.key[i:i + self.ps]
                slots, tick = self.pages[(root.namespace, tuple(prefix))]
                assert slots == node.value[i:i + self.ps]
                ticks.add(tick)
            assert len(ticks) == 1, "pages of one node were used at different times"
            by_tick.append((node.last_access, ticks.pop()))
        by_tick.sort()
        for (t1, r1), (t2, r2) in pairwise(by_tick):
            assert r1 <= r2 and (t1 == t2) == (r1 == r2), "LRU order differs from the reference"

    @invariant()
    def accounting_is_exact(self) -> None:
        self.cache.check_invariants()
        in_flight = [s for r in self.requests for s in r.own_slots]
        tree = list(self.owner)
        every = self.pool.free + tree + in_flight
        assert sorted(every) == list(range(CAPACITY)), "slots are not a partition"
        locked = sum(1 for page, n in self.locks.items() if n) * self.ps
        assert self.cache.protected_size == locked
        assert self.cache.evictable_size == len(self.pages) * self.ps - locked
        assert (len(self.pool.free) + self.cache.evictable_size + self.cache.protected_size
                + len(in_flight) == CAPACITY)


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRadixMachine = RadixMachine.TestCase
