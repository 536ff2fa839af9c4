"""The router's approximate radix tree: the request text it sent to each worker, so it can send a
new request where its longest prefix probably still sits in the worker's KV cache.

Approximate because the router cannot see the workers' caches: it records what it sent, as
characters of the routing key (request_keys.py), not tokens, and forgets a worker's oldest
entries once it holds more than `max_chars_per_worker` of them (the worker's own cache evicts
too). One tree serves all workers; each node records which workers hold it and when they last
used it. A worker that holds a node holds all of its ancestors, so a walk down the tree only
ever loses holders.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable


class _Node:
    __slots__ = ("key", "parent", "children", "workers")

    def __init__(self, key: str, parent: "_Node | None"):
        self.key = key  # the edge's characters, from the parent to this node
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by the first character of their key
        self.workers: dict[str, int] = {}  # worker -> last use (a tick of the tree's clock)


def _common_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of `edge` and text[pos:]; C-speed comparisons (prompts are
    thousands of characters), binary search on a mismatch."""
    if text.startswith(edge, pos):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - pos)  # edge[:low] matches; edge[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    def __init__(self, max_chars_per_worker: int = 4_000_000):
        self.max_chars = max_chars_per_worker
        self.root = _Node("", None)
        self._size: dict[str, int] = {}  # characters each worker holds
        self._clock = itertools.count(1)

    def size(self, worker: str) -> int:
        return self._size.get(worker, 0)

    def match(self, text: str, workers: Iterable[str]) -> tuple[int, set[str]]:
        """The longest prefix of `text` that any of `workers` holds: (its length, the workers
        holding that much). (0, set()) when none holds even its first character."""
        allowed = set(workers)
        best_len, best = 0, set()
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            holders = allowed.intersection(child.workers)
            if not holders:
                break
            n = _common_len(child.key, text, pos)
            best_len, best = pos + n, holders
            if n < len(child.key):
                break
            node, pos = child, pos + n
        return best_len, best

    def insert(self, text: str, worker: str) -> None:
        """Records that `worker` was sent `text` (and so holds all its prefixes), now."""
        tick = next(self._clock)
        node, pos = self.root, 0
        node.workers[worker] = tick
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
            else:
                n = _common_len(child.key, text, pos)
                if n < len(child.key):
                    child = self._split(child, n)
            if worker not in child.workers:
                self._size[worker] = self._size.get(worker, 0) + len(child.key)
            child.workers[worker] = tick
            node, pos = child, pos + len(child.key)
        if self._size.get(worker, 0) > self.max_chars:
            self._evict(worker, int(self.max_chars * 0.9))

    def forget(self, worker: str) -> None:
        """Drops everything `worker` held (it restarted: its cache is empty)."""
        self._evict(worker, 0)
        self.root.workers.pop(worker, None)
        self._size.pop(worker, None)

    def _split(self, node: _Node, n: int) -> _Node:
        """Cuts node's edge after n characters; returns the new upper part (same holders)."""
        parent = node.parent
        upper = _Node(node.key[:n], parent)
        upper.workers = dict(node.workers)
        parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, worker: str, target: int) -> None:
        """Removes `worker` from its least recently used leaves (nodes it holds and none of whose
        children it holds) until it holds at most `target` characters."""
        heap = [(n.workers[worker], id(n), n) for n in self._worker_leaves(worker)]
        heapq.heapify(heap)
        while heap and self._size.get(worker, 0) > target:
            _, _, node = heapq.heappop(heap)
            del node.workers[worker]
            self._size[worker] -= len(node.key)
            parent = node.parent
            if not node.workers:  # no holder left: none of its children has one either
                del parent.children[node.key[0]]
            if parent is not self.root and worker in parent.workers and \
                    not any(worker in c.workers for c in parent.children.values()):
                heapq.heappush(heap, (parent.workers[worker], id(parent), parent))

    def _worker_leaves(self, worker: str) -> list[_Node]:
        leaves, stack = [], [c for c in self.root.children.values() if worker in c.workers]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if worker in c.workers]
            if held:
                stack += held
            else:
                leaves.append(node)
        return leaves
