"""One radix tree over two KV tiers: the device pool (L1) and a host-memory pool (L2).

Pure Python like cache.py: the tree decides where each node's KV lives and queues the copies
(`KVMove`s) for the engine. Every node is in one of three states:

  D   `value` (device slots) only;
  DH  `value` and `host_value` (a host copy: demoting it again costs no copy);
  H   `host_value` only: evicted from the device, kept on the host.

Device residency is prefix-closed (an H node's descendants are all H), so a match is a device
part followed by a host part. Device eviction demotes the least recently used device leaf
instead of dropping it (a D node is copied to the host first, making room by dropping the
host's least recently used copies); a node is dropped only when the host has no room either.
`load_back` turns a match's host part into device KV again before the request's prefill.

Locks protect device KV only; a match's host part is loaded back in the scheduler call that
matched it, pinned against host eviction meanwhile, so an abort cannot leak host state.

The copies are taken as one batch before the next forward (`take_moves`), demotions first,
so the engine runs a step's load-backs together, layer by layer. Safe: a demotion may free
device slots a load-back then fills, but a node loaded since the last `take_moves` keeps its
host copy (not host-evictable until then), so no demotion writes host rows a load-back reads.

Invariants (check_invariants): device free + evictable + protected == capacity as before;
host free + used == host capacity; a node has `value` or `host_value`; an H node's
children are H.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from .cache import MatchResult, RadixCache, TreeNode
from .host_slots import HostSlots

__all__ = ["KVMove", "TieredMatch", "TieredRadixCache"]

# What a cached token on the host saves, for admission order, against one on the device: loading
# it back costs a copy (an 8B model on an H200: ~2.6 us a token at 50 GB/s, against ~27 us to
# prefill it) and device slots that evict another prefix.
HOST_TOKEN_WEIGHT = 0.9


@dataclass(frozen=True, slots=True)
class KVMove:
    """Copy the KV of `device_slots` to `host_slots` ("d2h") or back ("h2d"), pairwise."""

    kind: str
    device_slots: list[int]
    host_slots: list[int]


@dataclass(frozen=True, slots=True)
class TieredMatch(MatchResult):
    """The device part (`slot_indices`, `node`, as MatchResult) and the host nodes after it."""

    host_nodes: list[TreeNode] = field(default_factory=list)

    @property
    def host_len(self) -> int:
        return sum(len(n.key) for n in self.host_nodes)


class TieredRadixCache(RadixCache):
    """RadixCache whose evicted nodes move to a host pool of `host_capacity` tokens.

    write_policy: "write_back" copies a node to the host when it leaves the device;
    "write_through" also copies every node as it is inserted (the host holds everything the
    device does, so eviction is free, at the cost of copying KV that may never be reused).
    """

    def __init__(self, capacity: int, free_slots: Callable[[list[int]], None], host_capacity: int,
                 page_size: int = 1, write_policy: str = "write_back") -> None:
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"write_policy must be write_back or write_through, got {write_policy!r}")
        if host_capacity < 1:
            raise ValueError(f"host_capacity must be >= 1, got {host_capacity}")
        self.host = HostSlots(host_capacity)
        self.write_policy = write_policy
        self.moves: list[KVMove] = []
        self._pinned: set[TreeNode] = set()  # host nodes being loaded back: not host-evictable
        self._loading: set[TreeNode] = set()  # loaded since the last take_moves: keep their host copy
        super().__init__(capacity, free_slots, page_size)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._host_used = 0
        self.host.reset()

    def reset_stats(self) -> None:
        super().reset_stats()
        self.host_hit_tokens = 0  # matched on the host and loaded back
        self.demoted_tokens = 0  # copied device -> host
        self.dropped_tokens = 0  # left the tree from both tiers

    @property
    def host_used(self) -> int:
        return self._host_used

    def take_moves(self) -> list[KVMove]:
        """The copies queued since the last call, demotions first (module docstring: why)."""
        moves, self.moves = self.moves, []
        self._loading.clear()
        return [m for m in moves if m.kind == "d2h"] + [m for m in moves if m.kind != "d2h"]

    def _is_leaf(self, node: TreeNode) -> bool:
        return node.value is not None and not any(c.value is not None for c in node.children.values())

    # ------------------------------------------------------------------ match
    def admission_priority(self, key: Sequence[int], namespace: Hashable = None) -> float:
        """The cached prefix's length, its host tokens counted HOST_TOKEN_WEIGHT each: among
        requests with equally long cached prefixes, the one whose prefix is still on the device
        goes first, before loading the others' back evicts it (chat turns returning together)."""
        return sum(tokens if node.value is not None else HOST_TOKEN_WEIGHT * tokens
                   for node, tokens in self._cached_path(key, namespace))

    def match(self, key: Sequence[int], namespace: Hashable = None, *, record_stats: bool = True) -> TieredMatch:
        """The longest cached prefix in either tier: its device part and the host nodes after it.

        Marks the whole matched path used now (LRU) and splits where the match ends.
        """
        if record_stats:
            self._queried_tokens += len(key)
        root = self._roots.get(namespace)
        if root is None:
            return TieredMatch([], self._root)
        self._clock += 1
        node, _ = self._walk(root, self._aligned(key), self._clock)
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        slots: list[int] = []
        device_node = root
        host_nodes: list[TreeNode] = []
        for n in path:
            if n.value is None:
                host_nodes.append(n)
            else:
                slots.extend(n.value)
                device_node = n
        if record_stats:
            self._hit_tokens += len(slots)
        return TieredMatch(slots, device_node, host_nodes)

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None, *,
                     record_stats: bool = True) -> MatchResult:
        """The device part of `match` (what a request can read without a load-back)."""
        m = self.match(key, namespace, record_stats=record_stats)
        return MatchResult(m.slot_indices, m.node)

    def load_back(self, match: TieredMatch, alloc: Callable[[int], list[int] | None]) -> TieredMatch:
        """Gives `match`'s host nodes device slots from `alloc(n)` (which may evict) and queues
        their host-to-device copies; they become DH. Returns the match extended over them, or
        `match` unchanged when `alloc` returns None. The caller holds a lock on `match.node`,
        so the eviction `alloc` may cause leaves the device part alone."""
        nodes = match.host_nodes
        if not nodes:
            return match
        self._pinned.update(nodes)
        try:
            slots = alloc(match.host_len)
        finally:
            self._pinned.difference_update(nodes)
        if slots is None:
            return match
        if any(n.evicted for n in nodes):  # cannot happen: pinned; a bug must not load wrong KV
            raise RuntimeError("load_back: a pinned host node was evicted")
        self._evictable_leaves.discard(match.node)
        self._loading.update(nodes)
        pos = 0
        for n in nodes:
            n.value = slots[pos:pos + len(n.key)]
            pos += len(n.key)
            self.moves.append(KVMove("h2d", n.value, n.host_value))
            self._evictable_size += len(n.key)  # n.lock_ref is 0: H nodes are never locked
        self._evictable_leaves.add(nodes[-1])
        self.host_hit_tokens += pos
        self._hit_tokens += pos
        return TieredMatch(match.slot_indices + slots, nodes[-1], [])

    # ------------------------------------------------------------------ insert
    def insert(self, key: Sequence[int], slot_indices: Sequence[int], namespace: Hashable = None) -> int:
        """As RadixCache.insert; host-only nodes on the path adopt the caller's slots for their
        tokens (they are on the device again), so the returned length is the device part."""
        if len(slot_indices) != len(key):
            raise ValueError(f"slot_indices has {len(slot_indices)} entries but key has "
                             f"{len(key)} tokens")
        key = self._aligned(key)
        n = len(key)
        if n == 0:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode([], [], None, namespace=namespace)
        self._clock += 1
        now = self._clock
        node, pos = self._walk(root, key, now)
        path: list[TreeNode] = []
        tail = node
        while tail.parent is not None and tail.value is None:
            path.append(tail)
            tail = tail.parent
        device_len = pos - sum(len(h.key) for h in path)
        start = device_len
        for h in reversed(path):  # parents first
            h.value = list(slot_indices[start:start + len(h.key)])
            start += len(h.key)
            self._evictable_size += len(h.key)
        if path:
            self._evictable_leaves.discard(tail)
            if node.lock_ref == 0 and self._is_leaf(node):
                self._evictable_leaves.add(node)
        if pos < n:
            leaf = TreeNode(key[pos:], list(slot_indices[pos:n]), node, now)
            node.children[tuple(key[pos:pos + self.page_size])] = leaf
            self._evictable_leaves.discard(node)
            self._evictable_leaves.add(leaf)
            self._evictable_size += n - pos
            if self.write_policy == "write_through":
                self._copy_to_host(leaf)
        return device_len

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Frees device slots of least recently used unlocked device leaves until `num_tokens`
        are freed, demoting each to the host (or dropping it when the host has no room)."""
        if num_tokens <= 0 or not self._evictable_leaves:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self._evictable_leaves.discard(node)
            size = len(node.key)
            if node.host_value is None:
                self._copy_to_host(node)
            slots = node.value
            self._evictable_size -= size
            freed += size
            if node.host_value is not None:
                node.value = None  # now H: its KV waits on the host
            else:
                self._drop_subtree(node)
            self._free_slots(slots)
            if parent.parent is not None:
                if parent.lock_ref == 0 and self._is_leaf(parent):
                    self._evictable_leaves.add(parent)
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
            elif not parent.children and parent is not self._root:
                del self._roots[parent.namespace]
        self._evicted_tokens += freed
        return freed

    def _copy_to_host(self, node: TreeNode) -> None:
        """Gives a device node a host copy (queued d2h), evicting host copies for room; leaves
        it without one when the host cannot make room."""
        size = len(node.key)
        if size > self.host.available_size:
            # A scan per call (O(tree)): free a slice of the pool at once so demoting many
            # nodes in a row does not rescan for each.
            self._evict_host(max(size - self.host.available_size, self.host.capacity // 64), keep=node)
        host = self.host.alloc(size)
        if host is None:
            return
        node.host_value = host
        self._host_used += size
        self.demoted_tokens += size
        self.moves.append(KVMove("d2h", node.value, host))

    def _evict_host(self, num_tokens: int, keep: TreeNode) -> int:
        """Frees host slots, least recently used first: host-only leaves leave the tree, device
        nodes lose their host copy. Pinned nodes, nodes loaded in this batch and `keep` stay."""
        candidates = [n for n in self._iter_nodes() if n.host_value is not None and n not in self._pinned
                      and n not in self._loading and (n.value is not None or not n.children) and n is not keep]
        heap = [(n.last_access, n.node_id, n) for n in candidates]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.evicted or node.host_value is None:
                continue
            freed += len(node.key)
            if node.value is not None:  # DH -> D
                self._release_host(node)
                continue
            parent = node.parent
            assert parent is not None
            self._detach(node)
            self.dropped_tokens += len(node.key)
            if (parent.parent is not None and parent.value is None and not parent.children
                    and parent not in self._pinned):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _release_host(self, node: TreeNode) -> None:
        self.host.free(node.host_value)
        self._host_used -= len(node.key)
        node.host_value = None

    def _detach(self, node: TreeNode) -> None:
        """Removes a childless node holding no device slots from the tree, freeing its host copy."""
        parent = node.parent
        del parent.children[tuple(node.key[:self.page_size])]
        if node.host_value is not None:
            self._release_host(node)
        node.evicted = True
        node.parent = None
        if parent.parent is None and not parent.children and parent is not self._root:
            del self._roots[parent.namespace]

    def _drop_subtree(self, node: TreeNode) -> None:
        """Drops a device leaf with no host copy, and the host-only nodes below it (their
        prefix is gone from both tiers, so they could never match)."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children first
            if n is not node:
                self.dropped_tokens += len(n.key)
                self._detach(n)
        node.value = None
        self.dropped_tokens += len(node.key)
        parent = node.parent
        del parent.children[tuple(node.key[:self.page_size])]
        node.evicted = True
        node.parent = None

    def reset(self) -> None:
        """Drops both tiers (device slots through `free_slots`) and the queued copies."""
        if self._protected_size:
            raise RuntimeError(f"reset: {self._protected_size} tokens are locked")
        slots = [s for node in self._iter_nodes() if node.value is not None for s in node.value]
        self._init_tree()
        self.reset_stats()
        self.moves = []
        self._loading.clear()
        if slots:
            self._free_slots(slots)

    # ------------------------------------------------------------------ introspection
    def tier_sizes(self) -> dict[str, int]:
        return {"device_tokens": self.total_size, "host_tokens": self._host_used,
                "host_capacity": self.host.capacity, "host_free": self.host.available_size}

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise RuntimeError(f"tiered radix invariant broken: {msg}")

        ps = self.page_size
        evictable = protected = host_used = 0
        leaves: set[TreeNode] = set()
        device_slots: set[int] = set()
        host_slots: set[int] = set()
        for node in self._iter_nodes():
            parent = node.parent
            assert parent is not None
            if not node.key or len(node.key) % ps:
                fail(f"{node!r}: key length {len(node.key)}")
            if parent.children.get(tuple(node.key[:ps])) is not node:
                fail(f"{node!r}: not under its first page in its parent")
            if node.value is None and node.host_value is None:
                fail(f"{node!r}: in neither tier")
            if node.value is not None and parent.parent is not None and parent.value is None:
                fail(f"{node!r}: on the device below a host-only parent")
            if node.value is None and node.lock_ref:
                fail(f"{node!r}: locked but not on the device")
            if parent.parent is not None and (parent.lock_ref < node.lock_ref
                                              or parent.last_access < node.last_access):
                fail(f"{node!r}: parent has a smaller lock_ref or last_access")
            for value, seen in ((node.value, device_slots), (node.host_value, host_slots)):
                if value is None:
                    continue
                if len(value) != len(node.key):
                    fail(f"{node!r}: {len(value)} slots for {len(node.key)} tokens")
                if seen.intersection(value) or len(set(value)) != len(value):
                    fail(f"{node!r}: a slot index is owned twice")
                seen.update(value)
            if node.host_value is not None:
                host_used += len(node.key)
            if node.value is not None:
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                    if self._is_leaf(node):
                        leaves.add(node)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            fail(f"device sizes {self._evictable_size}, {self._protected_size} != recomputed "
                 f"{evictable}, {protected}")
        if leaves != self._evictable_leaves:
            fail("evictable leaf set out of date")
        if evictable + protected > self.capacity:
            fail(f"{evictable + protected} tokens on the device, capacity {self.capacity}")
        if host_used != self._host_used or host_used + self.host.available_size != self.host.capacity:
            fail(f"host used {self._host_used} (recomputed {host_used}) + free {self.host.available_size} "
                 f"!= capacity {self.host.capacity}")
