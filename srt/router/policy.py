"""Which worker gets a request.

cache_aware (the default): the worker holding the longest prefix of the request's key in the
router's prefix tree. A request whose best match covers less than `cache_threshold` of its key
(or that has no key) starts a new prefix: it goes to the worker holding the least text in the
tree, which spreads prefixes (and so the later requests that share them) evenly over the
workers; loads at the moment a prefix first arrives say little about the load its followers
will bring. Either way, when the chosen worker has more than `balance_threshold` requests in
flight (through the router) beyond the least-loaded worker, the least-loaded one gets it.
round_robin: the next healthy worker in turn (the baseline of the benchmark).
least_load: the worker with the fewest requests in flight.
"""

from __future__ import annotations

import itertools

from .prefix_tree import PrefixTree
from .workers import Worker

POLICIES = ("cache_aware", "round_robin", "least_load")


class LeastLoad:
    name = "least_load"

    def __init__(self, tree: PrefixTree | None = None):
        self.tree = tree or PrefixTree()

    def least_loaded(self, candidates: list[Worker]) -> Worker:
        return min(candidates, key=lambda w: (w.in_flight, self.tree.size(w.url), w.requests, w.url))

    def pick(self, key: str | None, candidates: list[Worker]) -> Worker:
        return self.least_loaded(candidates)

    def on_dispatch(self, key: str | None, worker: Worker) -> None:
        pass

    def forget(self, worker: Worker) -> None:
        self.tree.forget(worker.url)


class RoundRobin(LeastLoad):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()

    def pick(self, key: str | None, candidates: list[Worker]) -> Worker:
        return candidates[next(self._turn) % len(candidates)]


class CacheAware(LeastLoad):
    name = "cache_aware"

    def __init__(self, tree: PrefixTree, balance_threshold: int = 32, cache_threshold: float = 0.5):
        super().__init__(tree)
        self.balance_threshold = balance_threshold
        self.cache_threshold = cache_threshold

    def pick(self, key: str | None, candidates: list[Worker]) -> Worker:
        least = self.least_loaded(candidates)
        if not key:
            return least
        matched, holders = self.tree.match(key, [w.url for w in candidates])
        if matched == 0 or matched < self.cache_threshold * len(key):
            best = min(candidates, key=lambda w: (self.tree.size(w.url), w.in_flight, w.requests, w.url))
        else:
            best = min((w for w in candidates if w.url in holders), key=lambda w: (w.in_flight, w.url))
        if best.in_flight - least.in_flight > self.balance_threshold:
            return least
        return best

    def on_dispatch(self, key: str | None, worker: Worker) -> None:
        if key:
            self.tree.insert(key, worker.url)


def make_policy(name: str, max_tree_chars: int, balance_threshold: int, cache_threshold: float) -> LeastLoad:
    if name == "cache_aware":
        return CacheAware(PrefixTree(max_tree_chars), balance_threshold, cache_threshold)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"policy: {name!r} is not one of {', '.join(POLICIES)}")
