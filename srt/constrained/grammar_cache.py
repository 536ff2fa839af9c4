"""Compiles grammars off the scheduler loop: once per spec, in a worker thread, with a timeout.

The scheduler submits a request's spec and polls; requests sharing a spec share one compile.
A compile that fails, or outlives the timeout, fails only the requests that wait on it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .backend import GrammarBackend
from .spec import GrammarSpec

CACHE_ENTRIES = 64  # compiled grammars kept here; a big regex compiles to a few MB


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None  # built on first use, in the worker
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[GrammarSpec, Future] = OrderedDict()

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def submit(self, spec: GrammarSpec) -> "PendingGrammar":
        future = self._futures.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, spec)
            self._futures[spec] = future
            while len(self._futures) > CACHE_ENTRIES:
                self._futures.popitem(last=False)
        self._futures.move_to_end(spec)
        return PendingGrammar(future, time.monotonic() + self.timeout_s)

    def _compile(self, spec: GrammarSpec) -> Any:
        return self.backend.compile(spec)


class PendingGrammar:
    """A request's view of its compile: done, failed (with a message), or still waiting."""

    def __init__(self, future: Future, deadline: float):
        self.future = future
        self.deadline = deadline

    def result(self) -> tuple[Any, str | None] | None:
        """(compiled, None) when ready, (None, error) when failed or timed out, None to wait."""
        if self.future.done():
            error = self.future.exception()
            if error is not None:
                return None, f"grammar compilation failed: {error}"
            return self.future.result(), None
        if time.monotonic() >= self.deadline:
            return None, "grammar compilation timed out"
        return None

    def wait(self, seconds: float) -> None:
        try:
            self.future.exception(timeout=seconds)
        except TimeoutError:
            pass
