"""Radix-tree prefix cache over token ids whose nodes hold KV-cache slot indices.

Pure Python (no torch): the scheduler owns the slot pool and passes a `free_slots` callback;
the tree only records which slots hold the KV of which token prefix.

Ownership protocol (the caller's allocator plus this tree account for every slot):
  * `match_prefix(key)` -> the longest cached prefix; the caller `lock`s its node while a
    request reads those slots, and `unlock`s it when done.
  * `insert(key, slots)` -> `cached_len`: `slots[:cached_len]` are NOT adopted (the tree already
    had that range); of those, the caller frees the ones it allocated itself (everything past
    the prefix it matched and locked earlier). `slots[cached_len:aligned_len]` now belong to the
    tree, where `aligned_len = len(key) // page_size * page_size`; the trailing partial page
    `slots[aligned_len:]` stays with the caller.
  * `evict(n)` and `reset()` hand slots back through `free_slots`.
Invariant: free slots (in the caller's pool) + evictable_size + protected_size == capacity,
whenever no request holds slots of its own outside the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from .prefix import common_prefix_len

__all__ = ["MatchResult", "RadixCache", "TreeNode"]

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: a run of whole pages of tokens and their KV slots.

    Invariants: len(key) == len(value), a positive multiple of page_size (roots: empty);
    `parent.children[tuple(key[:page_size])] is self`; lock_ref >= every child's lock_ref;
    last_access >= every child's last_access.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id",
                 "evicted", "namespace", "host_value")

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None,
                 last_access: int = 0, lock_ref: int = 0, namespace: Hashable = None) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = lock_ref
        self.last_access = last_access
        self.node_id = next(_node_ids)  # tie-break in the eviction heap: deterministic order
        self.evicted = False
        self.namespace = namespace  # meaningful on roots only
        self.host_value: list[int] | None = None  # host-tier slots (tiered.py); value is then None or a copy

    def __repr__(self) -> str:
        head = self.key[:4]
        more = "..." if len(self.key) > 4 else ""
        return (f"TreeNode(id={self.node_id}, key={head}{more}, len={len(self.key)}, "
                f"lock_ref={self.lock_ref})")


@dataclass(frozen=True, slots=True)
class MatchResult:
    """`slot_indices` of the longest cached prefix; `node` is where the match ends (lock it).

    With no match, `node` is a root; lock/unlock on a root are no-ops.
    """

    slot_indices: list[int]
    node: TreeNode

    @property
    def matched_len(self) -> int:
        return len(self.slot_indices)


class RadixCache:
    """Prefix cache: match, insert, lock/unlock, LRU-evict whole leaf nodes.

    Sizes are token counts kept exact incrementally: `evictable_size` sums nodes with
    lock_ref == 0, `protected_size` nodes with lock_ref > 0. Every namespace (cache salt,
    LoRA id; None is the default) has its own root, so prefixes never match across them.
    Keys are cut to whole pages; children are keyed by their first page, so nodes only
    split at page boundaries. Not thread-safe: the scheduler calls it from one thread.
    `free_slots` must not raise (the tree has already let go of the slots it is given).
    """

    def __init__(self, capacity: int, free_slots: Callable[[list[int]], None],
                 page_size: int = 1, disable: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self.disable = disable
        self._free_slots = free_slots
        self._clock = 0  # logical time: strictly increasing, so LRU order is deterministic
        self.reset_stats()
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = TreeNode([], [], None)
        self._roots: dict[Hashable, TreeNode] = {None: self._root}
        self._evictable_leaves: set[TreeNode] = set()  # unlocked, childless, non-root nodes
        self._evictable_size = 0
        self._protected_size = 0

    # ------------------------------------------------------------------ sizes and stats
    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def stats(self) -> dict[str, float]:
        """Hit statistics since construction, `reset()` or `reset_stats()`."""
        queried = self._queried_tokens
        return {"queried_tokens": queried, "hit_tokens": self._hit_tokens,
                "hit_rate": self._hit_tokens / queried if queried else 0.0,
                "evicted_tokens": self._evicted_tokens}

    def reset_stats(self) -> None:
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evicted_tokens = 0

    # ------------------------------------------------------------------ match and insert
    def _aligned(self, key: Sequence[int]) -> list[int]:
        """`key` as a list cut to whole pages (copies only when it must)."""
        n = len(key) - len(key) % self.page_size
        if isinstance(key, list) and n == len(key):
            return key
        return list(key[:n])

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None, *,
                     record_stats: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key` in `namespace`.

        Splits the last node when the match ends inside it (so the returned node covers
        exactly the match) and marks the matched path as used now (LRU).
        """
        if record_stats:  # False for the cache's own bookkeeping (re-matching what was just inserted)
            self._queried_tokens += len(key)
        root = self._roots.get(namespace)
        if self.disable or root is None:
            return MatchResult([], root if root is not None else self._root)
        key = self._aligned(key)
        self._clock += 1
        node, pos = self._walk(root, key, self._clock)
        if record_stats:
            self._hit_tokens += pos
        values: list[list[int]] = []
        tail = node
        while tail.parent is not None:
            values.append(tail.value)
            tail = tail.parent
        slots: list[int] = []
        for value in reversed(values):
            slots.extend(value)
        return MatchResult(slots, node)

    def cached_prefix_len(self, key: Sequence[int], namespace: Hashable = None) -> int:
        """What `match_prefix` would match, read-only: no split, no LRU touch, no statistics.
        For scheduling priority, which may ask about the same request many times."""
        return sum(tokens for _, tokens in self._cached_path(key, namespace))

    def admission_priority(self, key: Sequence[int], namespace: Hashable = None) -> float:
        """How much prefill the cache saves a request of `key`, for the waiting queue's
        longest-prefix-first order: its cached prefix's length."""
        return self.cached_prefix_len(key, namespace)

    def _cached_path(self, key: Sequence[int], namespace: Hashable = None) -> list[tuple[TreeNode, int]]:
        """The nodes `match_prefix` would walk for `key`, each with how many of its tokens
        match (whole pages), read-only."""
        root = self._roots.get(namespace)
        if self.disable or root is None:
            return []
        key = self._aligned(key)
        ps, n, pos, node = self.page_size, len(key), 0, root
        path: list[tuple[TreeNode, int]] = []
        while pos < n:
            child = node.children.get(tuple(key[pos:pos + ps]))
            if child is None:
                break
            m = common_prefix_len(child.key, key, pos)
            if m < len(child.key):
                path.append((child, m - m % ps))
                break
            path.append((child, m))
            pos += m
            node = child
        return path

    def _walk(self, node: TreeNode, key: list[int], now: int) -> tuple[TreeNode, int]:
        """Follows `key` down from `node`, marking the path used at `now`.

        Returns the deepest node matched (split so that it ends where the match ends) and
        the matched length.
        """
        ps = self.page_size
        n = len(key)
        pos = 0
        while pos < n:
            child = node.children.get(tuple(key[pos:pos + ps]))
            if child is None:
                break
            child_key = child.key
            child_len = len(child_key)
            if key[pos:pos + child_len] == child_key:  # common case: the whole edge matches
                child.last_access = now
                pos += child_len
                node = child
                continue
            # The first page matched, so the aligned match is at least one page long.
            m = common_prefix_len(child_key, key, pos)
            node = self._split(child, m - m % ps)
            node.last_access = now
            pos += len(node.key)
            break
        return node, pos

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cuts `child` after m tokens (0 < m < len, page-aligned); returns the new upper part.

        The upper part inherits lock_ref and last_access: every lock and access of `child`
        also covered these tokens. Sizes and the set of leaves do not change.
        """
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)  # internal: callers guarantee it
        value, host = child.value, child.host_value  # either may be None in a tiered tree
        upper = TreeNode(child.key[:m], None if value is None else value[:m], parent, child.last_access,
                         child.lock_ref)
        parent.children[tuple(child.key[:self.page_size])] = upper
        child.key = child.key[m:]
        if value is not None:
            child.value = value[m:]
        if host is not None:
            upper.host_value, child.host_value = host[:m], host[m:]
        child.parent = upper
        upper.children[tuple(child.key[:self.page_size])] = child
        return upper

    def insert(self, key: Sequence[int], slot_indices: Sequence[int],
               namespace: Hashable = None) -> int:
        """Caches `key` -> `slot_indices`; returns how many tokens of `key` were cached before.

        See the module docstring for which slots the tree adopts. Disabled: returns 0 and
        adopts nothing, so the caller frees every slot itself.
        """
        if len(slot_indices) != len(key):
            raise ValueError(f"slot_indices has {len(slot_indices)} entries but key has "
                             f"{len(key)} tokens")
        if self.disable:
            return 0
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
        if pos < n:
            leaf = TreeNode(key[pos:], list(slot_indices[pos:n]), node, now)
            node.children[tuple(key[pos:pos + self.page_size])] = leaf
            self._evictable_leaves.discard(node)
            self._evictable_leaves.add(leaf)
            self._evictable_size += n - pos
        return pos

    # ------------------------------------------------------------------ locking
    def lock(self, node: TreeNode) -> None:
        """Protects `node` and its ancestors (not the root) from eviction; nests."""
        if node.evicted:
            raise ValueError(f"lock: {node!r} was evicted; match again")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undoes one `lock(node)`. Raises RuntimeError if `node` is not locked."""
        if node.evicted:
            raise RuntimeError(f"unlock: {node!r} was evicted, so it was not locked")
        if node.parent is None:
            return  # a root
        if node.lock_ref <= 0:  # ancestors' lock_ref >= node's, so checking here suffices
            raise RuntimeError(f"unlock: {node!r} is not locked")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if self._is_leaf(node):
                    self._evictable_leaves.add(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def _is_leaf(self, node: TreeNode) -> bool:
        """Whether `node` is a leaf for eviction (a tiered tree: no child on the device)."""
        return not node.children

    def evict(self, num_tokens: int) -> int:
        """Frees least-recently-used unlocked leaves until `num_tokens` are freed.

        Whole nodes go, so the result may exceed `num_tokens`; it is smaller only when
        everything evictable is gone. Returns the number of tokens freed.
        """
        if num_tokens <= 0 or not self._evictable_leaves:
            return 0
        # Built per call from the maintained leaf set: O(leaves), no stale entries to skip.
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.key[:self.page_size])]
            self._evictable_leaves.discard(node)
            node.evicted = True
            node.parent = None
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            self._free_slots(node.value)
            if parent.children:
                continue
            if parent.parent is not None:
                if parent.lock_ref == 0:  # a new evictable leaf, possibly older than others
                    self._evictable_leaves.add(parent)
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
            elif parent is not self._root:
                del self._roots[parent.namespace]  # per-request salts would pile up empty roots
        self._evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drops every node, handing all cached slots to `free_slots` (one call), and the stats.

        Raises RuntimeError, changing nothing, while any node is locked.
        """
        if self._protected_size:
            raise RuntimeError(f"reset: {self._protected_size} tokens are locked")
        slots = [s for node in self._iter_nodes() for s in node.value]
        self._init_tree()
        self.reset_stats()
        if slots:
            self._free_slots(slots)

    # ------------------------------------------------------------------ introspection
    def _iter_nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out: list[TreeNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def node_count(self) -> int:
        """Number of non-root nodes (walks the tree)."""
        return len(self._iter_nodes())

    def check_invariants(self) -> None:
        """Recomputes everything kept incrementally (O(tree)); raises RuntimeError on a mismatch.

        For tests and debugging.
        """
        def fail(msg: str) -> None:
            raise RuntimeError(f"radix invariant broken: {msg}")

        ps = self.page_size
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        seen_slots: set[int] = set()
        for node in self._iter_nodes():
            parent = node.parent
            assert parent is not None
            if not node.key or len(node.key) % ps or len(node.key) != len(node.value):
                fail(f"{node!r}: key/value lengths {len(node.key)}/{len(node.value)}")
            if parent.children.get(tuple(node.key[:ps])) is not node:
                fail(f"{node!r}: not under its first page in its parent")
            if parent.parent is not None and (parent.lock_ref < node.lock_ref
                                              or parent.last_access < node.last_access):
                fail(f"{node!r}: parent has a smaller lock_ref or last_access")
            if node.lock_ref < 0 or node.evicted:
                fail(f"{node!r}: negative lock_ref or evicted but reachable")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
            if seen_slots.intersection(node.value) or len(set(node.value)) != len(node.value):
                fail(f"{node!r}: a slot index is owned twice")
            seen_slots.update(node.value)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            fail(f"sizes {self._evictable_size}, {self._protected_size} != "
                 f"recomputed {evictable}, {protected}")
        if leaves != self._evictable_leaves:
            fail("evictable leaf set out of date")
        if evictable + protected > self.capacity:
            fail(f"{evictable + protected} tokens cached, capacity {self.capacity}")
