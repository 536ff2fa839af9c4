"""TieredRadixCache: device + host tiers under one tree.

The state machine runs the tree against fake device and host memories whose cells record which
token prefix they hold: the queued copies are applied as the engine would (before the next
forward writes), and every match must hand back slots holding exactly the matched tokens'
KV, whichever tier it came from. Accounting is exact in both tiers after every step.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixlm.radix.tiered import KVMove, TieredMatch, TieredRadixCache

CAPACITY = 24
HOST_CAPACITY = 40


class Memory:
    """Device pool and host pool cells: each holds the (namespace, prefix) whose KV it stores."""

    def __init__(self, capacity: int, host_capacity: int) -> None:
        self.free = list(range(capacity))
        self.capacity = capacity
        self.device: dict[int, object] = {}
        self.host: list[object] = [None] * host_capacity

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, slots: list[int]) -> None:
        assert not set(slots) & set(self.free), "a slot was freed twice"
        self.free.extend(slots)

    def apply(self, moves: list[KVMove]) -> None:
        for m in moves:
            for d, h in zip(m.device_slots, m.host_slots):
                if m.kind == "d2h":
                    self.host[h] = self.device[d]
                else:
                    self.device[d] = self.host[h]


def cells(ns: Hashable, key: list[int], start: int, end: int) -> list[object]:
    return [(ns, tuple(key[:i + 1])) for i in range(start, end)]


def make(page_size: int = 1, write_policy: str = "write_back") -> tuple[TieredRadixCache, Memory]:
    mem = Memory(CAPACITY, HOST_CAPACITY)
    tree = TieredRadixCache(CAPACITY, mem.release, HOST_CAPACITY, page_size, write_policy)
    return tree, mem


def alloc_evicting(tree: TieredRadixCache, mem: Memory, n: int) -> list[int] | None:
    if n > len(mem.free):
        tree.evict(n - len(mem.free))
    return mem.alloc(n)


def run_request(tree: TieredRadixCache, mem: Memory, ns: Hashable, key: list[int]) -> TieredMatch | None:
    """What a finished request does: match, load back, compute the rest, insert, unlock."""
    match = tree.match(key, ns)
    tree.lock(match.node)
    loaded = tree.load_back(match, lambda n: alloc_evicting(tree, mem, n))
    tree.lock(loaded.node)
    tree.unlock(match.node)
    mem.apply(tree.take_moves())
    got = [mem.device[s] for s in loaded.slot_indices]
    assert got == cells(ns, key, 0, loaded.matched_len), "a match returned another prefix's KV"
    rest = alloc_evicting(tree, mem, len(key) - loaded.matched_len)
    if rest is None:
        tree.unlock(loaded.node)
        mem.apply(tree.take_moves())
        return None
    mem.apply(tree.take_moves())  # before the forward writes the new slots
    for s, c in zip(rest, cells(ns, key, loaded.matched_len, len(key))):
        mem.device[s] = c
    slots = loaded.slot_indices + rest
    already = tree.insert(key, slots, ns)
    mem.release(slots[loaded.matched_len:already])
    aligned = len(key) - len(key) % tree.page_size
    mem.release(slots[max(already, aligned):])
    tree.unlock(loaded.node)
    mem.apply(tree.take_moves())
    return loaded


def test_evicted_prefix_comes_back_from_the_host() -> None:
    tree, mem = make()
    key = list(range(10))
    run_request(tree, mem, None, key)
    assert tree.evict(CAPACITY) == 10
    mem.apply(tree.take_moves())
    assert tree.match_prefix(key).matched_len == 0
    assert tree.cached_prefix_len(key) == 10  # the host tier counts for scheduling priority
    loaded = run_request(tree, mem, None, key + [99])
    assert loaded.matched_len == 10 and tree.host_hit_tokens == 10
    tree.check_invariants()


def test_a_prefix_on_the_device_is_admitted_before_an_equal_one_on_the_host() -> None:
    """Chat turns returning together: the conversation whose history is still on the device goes
    first; loading the others back first would evict it. A longer prefix still wins."""
    tree, mem = make()
    on_host, on_device, longer = list(range(10)), list(range(100, 110)), list(range(200, 216))
    for key in (on_host, longer):
        run_request(tree, mem, None, key)
    tree.evict(CAPACITY)
    mem.apply(tree.take_moves())
    run_request(tree, mem, None, on_device)
    assert [tree.cached_prefix_len(k) for k in (on_host, on_device, longer)] == [10, 10, 16]
    priority = [tree.admission_priority(k + [7]) for k in (on_host, on_device, longer)]
    assert priority[1] == 10 and priority[1] > priority[0] > 0 and priority[2] > priority[1]


def test_a_node_is_dropped_only_when_the_host_is_full() -> None:
    mem = Memory(CAPACITY, 8)
    tree = TieredRadixCache(CAPACITY, mem.release, 8)
    run_request(tree, mem, None, list(range(6)))
    run_request(tree, mem, None, list(range(100, 106)))
    tree.evict(CAPACITY)  # 12 tokens leave the device; the host keeps the newer 6 at most
    mem.apply(tree.take_moves())
    tree.check_invariants()
    assert tree.host_used <= 8 and tree.dropped_tokens >= 4
    assert tree.cached_prefix_len(list(range(100, 106))) == 6


def test_a_batch_never_demotes_into_host_slots_it_loads_from() -> None:
    """A is loaded back; a second admission in the same step needs host room. A's host copy
    must stay (its copy has not run yet); the demotion that wanted the room drops C instead."""
    mem = Memory(16, 8)
    tree = TieredRadixCache(16, mem.release, 8)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    for key in (a, b, c):  # A goes to the host, which it fills
        run_request(tree, mem, None, key)
    match = tree.match(a)
    tree.lock(match.node)
    loaded = tree.load_back(match, lambda n: alloc_evicting(tree, mem, n))
    assert loaded.matched_len == 8
    tree.lock(loaded.node)
    assert alloc_evicting(tree, mem, 8) is not None  # D's prefill pushes C out
    mem.apply(tree.take_moves())
    assert [mem.device[s] for s in loaded.slot_indices] == cells(None, a, 0, 8)
    assert tree.cached_prefix_len(c) == 0 and tree.cached_prefix_len(a) == 8
    tree.check_invariants()


def test_write_through_copies_on_insert_and_evicts_without_copying() -> None:
    tree, mem = make(write_policy="write_through")
    run_request(tree, mem, None, list(range(5)))
    assert tree.host_used == 5
    tree.evict(5)
    assert all(m.kind != "d2h" for m in tree.take_moves())
    tree.check_invariants()


def test_namespaces_stay_apart_in_the_host_tier() -> None:
    tree, mem = make()
    run_request(tree, mem, "a", [1, 2, 3, 4])
    tree.evict(CAPACITY)
    mem.apply(tree.take_moves())
    assert tree.match([1, 2, 3, 4], "b").host_len == 0
    assert tree.match([1, 2, 3, 4], "a").host_len == 4


def test_reset_clears_both_tiers() -> None:
    tree, mem = make()
    run_request(tree, mem, None, list(range(8)))
    tree.evict(4)
    tree.reset()
    assert tree.host_used == 0 and tree.total_size == 0 and len(mem.free) == CAPACITY
    assert tree.host.available_size == HOST_CAPACITY


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="write_policy"):
        TieredRadixCache(8, lambda s: None, 8, write_policy="sometimes")
    with pytest.raises(ValueError, match="host_capacity"):
        TieredRadixCache(8, lambda s: None, 0)


KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=12)
NAMESPACES = st.sampled_from([None, "salt"])


class TieredMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["write_back", "write_through"]))
    def setup(self, page_size: int, policy: str) -> None:
        self.tree, self.mem = make(page_size, policy)
        self.held: list[tuple[TieredMatch, list[int]]] = []  # running requests: lock + own slots

    @rule(ns=NAMESPACES, key=KEYS)
    def finished_request(self, ns: Hashable, key: list[int]) -> None:
        run_request(self.tree, self.mem, ns, key)

    @rule(ns=NAMESPACES, key=KEYS)
    def start_request(self, ns: Hashable, key: list[int]) -> None:
        """A request that keeps its prefix locked (and slots of its own) across steps."""
        match = self.tree.match(key, ns)
        self.tree.lock(match.node)
        loaded = self.tree.load_back(match, lambda n: alloc_evicting(self.tree, self.mem, n))
        self.tree.lock(loaded.node)
        self.tree.unlock(match.node)
        own = alloc_evicting(self.tree, self.mem, 2) or []
        self.mem.apply(self.tree.take_moves())
        self.held.append((loaded, own))

    @rule(ns=NAMESPACES, keys=st.lists(KEYS, min_size=2, max_size=4))
    def start_batch(self, ns: Hashable, keys: list[list[int]]) -> None:
        """Several requests admitted into one step: their copies run together (take_moves'
        order) only when the step is launched, and each must then read its own prefix."""
        admitted = []
        for key in keys:
            match = self.tree.match(key, ns)
            self.tree.lock(match.node)
            loaded = self.tree.load_back(match, lambda n: alloc_evicting(self.tree, self.mem, n))
            self.tree.lock(loaded.node)
            self.tree.unlock(match.node)
            admitted.append((key, loaded))
        self.mem.apply(self.tree.take_moves())
        for key, loaded in admitted:
            got = [self.mem.device[s] for s in loaded.slot_indices]
            assert got == cells(ns, key, 0, loaded.matched_len), "a batched load-back read another prefix's KV"
            self.held.append((loaded, []))

    @rule(pick=st.integers(0, 1 << 16))
    def end_request(self, pick: int) -> None:
        if self.held:
            loaded, own = self.held.pop(pick % len(self.held))
            self.tree.unlock(loaded.node)
            self.mem.release(own)

    @rule(n=st.integers(0, CAPACITY))
    def evict(self, n: int) -> None:
        self.tree.evict(n)
        self.mem.apply(self.tree.take_moves())

    @rule()
    def reset(self) -> None:
        if not self.held:
            self.tree.reset()

    @invariant()
    def accounting(self) -> None:
        self.tree.check_invariants()
        held = sum(len(own) for _, own in self.held)
        assert len(self.mem.free) + self.tree.evictable_size + self.tree.protected_size + held == CAPACITY

    @invariant()
    def every_tier_holds_its_tokens(self) -> None:
        for node in self.tree._iter_nodes():
            root = node
            prefix: list[int] = []
            chain = []
            while root.parent is not None:
                chain.append(root)
                root = root.parent
            for n in reversed(chain):
                prefix.extend(n.key)
            start = len(prefix) - len(node.key)
            want = cells(root.namespace, prefix, start, len(prefix))
            if node.value is not None:
                assert [self.mem.device[s] for s in node.value] == want
            if node.host_value is not None:
                assert [self.mem.host[h] for h in node.host_value] == want


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
