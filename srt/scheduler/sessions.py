"""Program sessions: the latest prefix of each running program (or chat conversation) stays
cached between its calls.

When a request naming a session finishes, its sequence is in the radix tree; the session then
holds a lock on that path (as a running request does), so eviction skips it, and lets go of the
path its previous call left. The next call extends that prefix and hits it. Within bounds only:
a session protects at most `max_tokens` (the head of its prefix), all sessions together at most
`total_tokens`, a session ends `ttl` seconds after its last activity, and when the KV pool
cannot make room for running work otherwise the scheduler releases protections
(`release_newest`). Beyond the bounds the prefix is plain LRU cache. No torch.

Over a bound, the most recently active sessions let go first. Programs come back in about the
order they left (each waits on its tool or its user for a while): the least recently active
one is the next to return, and the one that just finished returns last. Letting go of the
oldest, as LRU would, drops each protection just before it pays; letting go of the newest
keeps a stable set protected until each program ends or expires. (On benchmarks/bench_agents.py
at the default bound the two orders measured alike, 1.07x and 1.09x: the bound, not the order,
limits that workload; docs/sessions.md.)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ...radix import RadixCache, TreeNode

logger = logging.getLogger(__name__)


@dataclass
class _Session:
    namespace: Hashable  # the tenant: its first request's cache namespace
    deadline: float
    node: TreeNode | None = None  # the locked end of the protected prefix; None: nothing protected
    tokens: int = 0  # its length


class Sessions:
    def __init__(self, tree: RadixCache, ttl: float, max_tokens: int, total_tokens: int,
                 clock: Callable[[], float] = time.monotonic):
        self.tree = tree
        self.ttl = ttl
        self.max_tokens = max_tokens
        self.total_tokens = total_tokens
        self.clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently active first
        self.protected_tokens = 0  # summed per session (a prefix shared by two counts twice)
        self.stats = {"ended": 0, "expired": 0, "budget_releases": 0, "pressure_releases": 0}

    def __len__(self) -> int:
        return len(self._sessions)

    def admit(self, session_id: str, namespace: Hashable) -> bool:
        """A request naming `session_id` arrived: False when the session belongs to another
        namespace (the front end refuses those; this guards the race with an ending session),
        else it counts as the session's activity."""
        session = self._sessions.get(session_id)
        if session is None:
            return True
        if session.namespace != namespace:
            logger.warning("session %r: a request from another namespace runs without it", session_id)
            return False
        self._touch(session_id, session)
        return True

    def keep(self, session_id: str, namespace: Hashable, key: Sequence[int]) -> None:
        """A request of the session finished and `key`, its sequence, is in the tree: protect
        its head up to max_tokens instead of the session's previous prefix."""
        if self.ttl <= 0 or self.tree.disable:
            return
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(namespace, 0.0)
        elif session.namespace != namespace:
            return
        self._touch(session_id, session)
        match = self.tree.match_prefix(key[:self.max_tokens], namespace, record_stats=False)
        if match.node is session.node:
            return
        old = (session.node, session.tokens)
        if match.matched_len:  # locked before the old lock goes, so the shared part never becomes evictable
            self.tree.lock(match.node)
        session.node, session.tokens = (match.node, match.matched_len) if match.matched_len else (None, 0)
        self.protected_tokens += session.tokens
        if old[0] is not None:
            self.tree.unlock(old[0])
            self.protected_tokens -= old[1]
        for other in reversed(list(self._sessions.values())):  # most recently active first: this one
            if self.protected_tokens <= self.total_tokens:
                break
            if other.node is not None:
                self._release(other)
                self.stats["budget_releases"] += 1

    def end(self, session_id: str) -> bool:
        """Ends the session (its prefix becomes plain cache); False when it is not known."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._release(session)
        self.stats["ended"] += 1
        return True

    def expire(self) -> None:
        """Ends the sessions idle for ttl seconds (cheap when none is: called every step)."""
        if not self._sessions:
            return
        now = self.clock()
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if session.deadline > now:
                return
            del self._sessions[session_id]
            self._release(session)
            self.stats["expired"] += 1

    def release_newest(self) -> bool:
        """Lets go of the most recently active protection (the one needed last), for running
        work that finds no room otherwise; False when nothing is protected."""
        for session in reversed(self._sessions.values()):
            if session.node is not None:
                self._release(session)
                self.stats["pressure_releases"] += 1
                return True
        return False

    def clear(self) -> None:
        """Releases every protection and forgets every session (the cache is being flushed)."""
        for session in self._sessions.values():
            self._release(session)
        self._sessions.clear()

    def info(self) -> dict[str, Any]:
        return {"ttl": self.ttl, "max_tokens": self.max_tokens, "total_tokens": self.total_tokens,
                "active": len(self._sessions), "protected_tokens": self.protected_tokens, **self.stats}

    def _touch(self, session_id: str, session: _Session) -> None:
        session.deadline = self.clock() + self.ttl
        self._sessions.move_to_end(session_id)

    def _release(self, session: _Session) -> None:
        if session.node is not None:
            self.tree.unlock(session.node)
            self.protected_tokens -= session.tokens
            session.node, session.tokens = None, 0
