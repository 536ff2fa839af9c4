"""The main process's serving life: the listening socket taken before anything loads, warm-up
before /health says 200, failing requests at once when a child dies, and shutdown on signals
(SIGTERM drains for up to --graceful-shutdown-timeout; Ctrl-C stops at once; a second signal
forces). Every request still open when the server stops gets an error, never a silent cut."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType
from typing import Any, Callable

import uvicorn

from ..process_utils import stage
from .tokenizer_manager import TokenizerManager

logger = logging.getLogger("radixlm.launch")

_WARMUP_PROMPT = "Warm-up: the quick brown fox jumps over the lazy dog."
_WARMUP_NEW_TOKENS = 4  # prefill, then decode steps: the two paths every request takes
_CHILD_POLL_S = 0.2


class Server(uvicorn.Server):
    """uvicorn's server with our reaction to signals and dead children.

    `state` is the app's ServerState; `dead_children()` lists children that exited."""

    def __init__(self, config: uvicorn.Config, state: Any, dead_children: Callable[[], list[str]],
                 graceful_timeout: float):
        super().__init__(config)
        self.state = state
        self.tm: TokenizerManager = state.tm
        self.dead_children = dead_children
        self.graceful_timeout = graceful_timeout
        self.exit_code = 0
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    # uvicorn installs this as the SIGINT/SIGTERM handler while serving.
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._loop is None:
            self.should_exit = True
        elif self._signals == 1:
            timeout = self.graceful_timeout if sig == signal.SIGTERM else 0.0
            self._loop.call_soon_threadsafe(self._start_drain, sig, timeout)
        elif self._signals == 2:
            self._loop.call_soon_threadsafe(self._start_drain, sig, 0.0)
        else:
            self.force_exit = True

    def _start_drain(self, sig: int, timeout: float) -> None:
        name = signal.Signals(sig).name
        if timeout > 0:
            stage(f"{name}: draining ({self.tm.num_active} requests in flight, up to {timeout:.0f}s)")
        else:
            stage(f"{name}: shutting down")
        self._tasks.append(asyncio.ensure_future(self._drain(timeout)))

    async def _drain(self, timeout: float) -> None:
        self.state.draining = True  # /health and new generation requests answer 503 from now on
        deadline = time.monotonic() + timeout
        while self.tm.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self._fail_in_flight("the server is shutting down")
        self.should_exit = True

    async def _fail_in_flight(self, reason: str) -> None:
        if self.tm.num_active:
            logger.warning("failing %d requests in flight: %s", self.tm.num_active, reason)
        self.tm.fail_all(reason)
        for _ in range(20):  # let handlers send their error bodies and final stream events
            if not self.tm.num_active:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)

    async def _watch_children(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(_CHILD_POLL_S)
            dead = self.dead_children()
            if dead:
                reason = "; ".join(dead)
                self.state.healthy, self.state.unhealthy_reason = False, reason
                logger.error("child process died (%s); shutting down", reason)
                self.exit_code = 1
                await self._fail_in_flight(f"a server process died ({reason})")
                await asyncio.sleep(1.0)  # let health probes see 503 before the port closes
                self.should_exit = True

    async def _warm_up(self) -> None:
        """One short request through tokenizer, scheduler and detokenizer: the first forward of
        each shape is slow (kernel selection, allocator growth); users should not pay for it."""
        while not self.started and not self.should_exit:
            await asyncio.sleep(0.05)
        started = time.perf_counter()
        try:
            ids = self.tm.intake.prompt_ids(_WARMUP_PROMPT)
            msg = self.tm.intake.samples(ids, {"max_new_tokens": _WARMUP_NEW_TOKENS, "temperature": 0,
                                               "ignore_eos": True})[0]
            await self.tm.generate_once(msg)
        except Exception as e:  # a failing warm-up is the server's fault: report it, keep serving
            logger.error("warm-up request failed: %s", e)
        self.state.warm = True
        stage(f"warmed up in {time.perf_counter() - started:.1f}s; ready at http://{self.config.host}:"
              f"{self.config.port}")

    async def run(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self.tm.start()
        self._tasks += [asyncio.ensure_future(self._watch_children()), asyncio.ensure_future(self._warm_up())]
        try:
            await self.serve(sockets=[sock])
        finally:
            for task in self._tasks:
                task.cancel()
