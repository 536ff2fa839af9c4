"""Async programs: `@function` on an `async def`, `await prog.arun(...)`, batches with a bound
on concurrency, and states handed out as their programs finish (docs/language.md).

An async program's state queues expressions as a sync one does (`s += gen(...)` returns at
once); one asyncio task per state runs them in order, awaiting the backend, and each fork
branch is a task of its own, so thousands of programs need no threads. A value the program
has not got yet is awaited (`await s.get("x")`, `await s.sync()`); `s["x"]` and `s.text()`
work once it is there. Cancelling the task that runs a program cancels its states' tasks,
which closes their HTTP requests: the server aborts them and frees their KV. A program that
raises does the same to its branches still running.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from .backend import Backend
from .interpreter import StreamExecutor
from .ir import CommitPrefix, Constant, Expr, ExprList, Gen, Select, VarScopeBegin, VarScopeEnd, names_in
from .sampling import SglSamplingParams
from .state import ProgramState, ProgramStateGroup

logger = logging.getLogger(__name__)

_END = object()
_NOT_READY = ("an async program awaits what it reads before it is ready: `await s.get(name)` or "
              "`await s.sync()`, then `s[name]` / `s.text()`")


class _LoopCondition:
    """Stands in for the sync executor's threading.Condition. Everything runs on one event
    loop, so there is nothing to lock; `notify_all` wakes the tasks awaiting `changed()`, and
    a blocking wait for something not there yet is an error saying to await it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __enter__(self) -> "_LoopCondition":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def notify_all(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def wait_for(self, predicate: Callable[[], Any]) -> Any:
        if not predicate():
            raise RuntimeError(_NOT_READY)
        return True

    async def changed(self) -> None:
        await self._event.wait()


class _ForkPoint(Expr):
    """Where the trunk forks: its text so far goes into the server's cache (so the branches
    share its KV), then each branch starts from a copy of the trunk's state at this point."""

    def __init__(self, branches: list["AsyncExecutor"], start: asyncio.Future):
        self.branches, self.start = branches, start

    async def run(self, trunk: "AsyncExecutor") -> None:
        if len(self.branches) > 1 and trunk.text_:
            await trunk.backend.acache_prefix(trunk.text_, *trunk.prefix_images())
        for child in self.branches:
            child.text_, child.messages_, child.images_ = trunk.text_, list(trunk.messages_), list(trunk.images_)
            child.variables, child.meta_info = dict(trunk.variables), dict(trunk.meta_info)
            child._role, child._role_start, child._content_start = trunk._role, trunk._role_start, trunk._content_start
            child._chat, child._calls = trunk._chat, list(trunk._calls)
            child.names_at_fork = set(trunk.variables)  # a join sets only the variables made after
        self.start.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.start.done():
            self.start.set_exception(error)
            self.start.exception()  # read here, so an unstarted branch's future is not "never retrieved"


class AsyncExecutor(StreamExecutor):
    """StreamExecutor's meaning of each expression, run by an asyncio task instead of a thread."""

    def __init__(self, backend: Backend, defaults: SglSamplingParams, stream: bool = False,
                 start: asyncio.Future | None = None):
        super().__init__(backend, defaults, stream)
        self._cond = _LoopCondition()  # type: ignore[assignment]
        self._aqueue: asyncio.Queue = asyncio.Queue()
        self._unfinished = 0  # queued expressions not yet run (or skipped)
        self._start = start  # a fork branch: the trunk's fork point
        self._task: asyncio.Task | None = None
        self.names_at_fork: set[str] = set()
        self.program_task: asyncio.Task | None = None  # a streamed run's program function

    # ---- submitting and waiting -------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        if self._ended:
            raise RuntimeError("this program state has ended; it takes no more expressions")
        for name in names_in(expr):
            self._pending[name] = self._pending.get(name, 0) + 1
        self._enqueue(expr)

    def _enqueue(self, item: Any) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._work_async())
        self._unfinished += 1
        self._aqueue.put_nowait(item)

    def end(self) -> None:
        for child in self.children:
            child.end()
        if self._ended:
            return
        self._ended = True
        if self._task is None:
            self.finished = True
            self._cond.notify_all()
        else:
            self._enqueue(_END)

    def sync(self) -> None:
        if self._unfinished and not self.finished:
            raise RuntimeError(_NOT_READY)

    def wait_finished(self) -> None:
        if not self.finished:
            raise RuntimeError(_NOT_READY)

    async def settled(self) -> None:
        """Every expression submitted so far has run (or was skipped after an error)."""
        while self._unfinished and not self.finished:
            await self._cond.changed()

    async def done(self) -> None:
        """This state and its fork branches have finished (call `end()` first)."""
        while not self.finished:
            await self._cond.changed()
        for child in self.children:
            await child.done()

    async def get_var_async(self, name: str) -> Any:
        while self._pending.get(name) and self.error_ is None:
            await self._cond.changed()
        return self.get_var(name)

    async def cancel(self) -> None:
        """Stops this state and its branches; returns once their requests in flight are
        closed (which aborts them on the server)."""
        tasks = []
        for executor in self._tree():
            if executor._task is not None and not executor._task.done():
                executor._task.cancel()
                tasks.append(executor._task)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _tree(self) -> list["AsyncExecutor"]:
        return [self] + [e for child in self.children for e in child._tree()]

    def fork(self, size: int) -> list["AsyncExecutor"]:  # type: ignore[override]
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork: size must be an integer >= 1, got {size!r}")
        start = asyncio.get_running_loop().create_future()
        branches = [AsyncExecutor(self.backend, self.defaults, self.stream, start) for _ in range(size)]
        for child in branches:
            child.session_id = self.backend.session_id() if self.session_id else None  # branches diverge
        self.children.extend(branches)
        point = _ForkPoint(branches, start)
        self.submit(point)
        return branches

    # ---- execution ---------------------------------------------------------------------------

    async def _work_async(self) -> None:
        if self._start is not None:
            try:
                await self._start
            except asyncio.CancelledError:
                self._stop(asyncio.CancelledError())
                raise
            except BaseException as e:  # the trunk failed before the fork: so does the branch
                self.record_error(e)
        while True:
            item = await self._aqueue.get()
            try:
                if item is _END:
                    self._stop(None)
                    return
                if self.error_ is None:
                    await self._execute_async(item)
                elif isinstance(item, _ForkPoint):
                    item.fail(self.error_)
            except asyncio.CancelledError:
                self._stop(asyncio.CancelledError())
                raise
            except BaseException as e:  # stored and raised to readers, as in the sync executor
                self.record_error(e)
            finally:
                self._unfinished -= 1
                self._cond.notify_all()

    def _stop(self, error: BaseException | None) -> None:
        if error is not None:
            self.record_error(error)
        self.finished = True
        while not self._aqueue.empty():  # fork points never reached: their branches fail
            item = self._aqueue.get_nowait()
            if isinstance(item, _ForkPoint):
                item.fail(self.error_ or RuntimeError("the program ended before this fork"))
        self._cond.notify_all()

    async def _execute_async(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                await self._execute_async(item)
        elif isinstance(expr, Gen):
            await self._gen_async(expr)
        elif isinstance(expr, Select):
            decision = await self.backend.aselect(self._select_prompt(expr), expr.choices, expr.temperature,
                                                  expr.method)
            self._select_finish(expr, decision)
        elif isinstance(expr, CommitPrefix):
            if self.text_:
                await self.backend.acache_prefix(self.text_, *self.prefix_images())
        elif isinstance(expr, _ForkPoint):
            await expr.run(self)
        else:
            if self._chat is None and not isinstance(expr, (Constant, VarScopeBegin, VarScopeEnd)):
                self._chat = await self.backend.aget_chat_template()  # roles render with it; fetch off the loop
            self._execute(expr)

    async def _gen_async(self, expr: Gen) -> None:
        if self._chat is None and getattr(expr, "tools", None):
            self._chat = await self.backend.aget_chat_template()
        prompt, params = self._gen_request(expr)
        if not self._streams(params):
            self._gen_finish(expr, params, await self.backend.agenerate(prompt, params))
            return
        value, meta = "", None
        self._stream_begin(expr.name)
        async for delta, meta in self.backend.agenerate_stream(prompt, params):
            value = self._stream_delta(expr.name, value, delta)
        self._gen_set(expr, value, meta)


class AsyncProgramState(ProgramState):
    """`s` in an async program: as ProgramState, with awaited reads (`await s.get(name)`,
    `await s.sync()`) and a fork whose `join()` is awaited."""

    _executor: AsyncExecutor

    async def get(self, name: str) -> Any:
        """The value of `name`, once the expression that sets it has run."""
        return await self._executor.get_var_async(name)

    async def sync(self) -> None:  # type: ignore[override]
        await self._executor.settled()

    async def wait(self) -> None:
        """With `arun(stream=True)`: waits for the program to end (its error: `s.error()`)."""
        if self._executor.program_task is not None:
            await self._executor.program_task

    def fork(self, size: int = 1) -> "AsyncProgramStateGroup":
        """`size` copies of this state from this point on, each run by its own task; the text
        so far is computed into the server's cache first, so the branches share its KV."""
        return AsyncProgramStateGroup([AsyncProgramState(e) for e in self._executor.fork(size)], self)

    async def text_iter(self, var: str | None = None) -> AsyncIterator[str]:  # type: ignore[override]
        """With `arun(stream=True)`: new text (of the state, or of one variable) as it arrives."""
        sent = 0
        executor = self._executor
        while True:
            current = executor._current(var) or ""
            if len(current) > sent:
                yield current[sent:]
                sent = len(current)
            if executor._var_done(var):
                return
            await executor._cond.changed()


class AsyncProgramStateGroup(ProgramStateGroup):
    """The branches of an async fork; `await group.join()`."""

    async def join(self) -> None:  # type: ignore[override]
        """Waits for every branch, then sets each variable the branches created in the parent
        as a list with one value per branch. A branch's error is raised here."""
        executors = [s._executor for s in self.states]
        for executor in executors:
            executor.end()
        for executor in executors:
            await executor.done()
        errors = [e.error_ for e in executors if e.error_ is not None]
        if errors:
            raise errors[0]
        at_fork = executors[0].names_at_fork
        new_names: list[str] = []
        for executor in executors:
            new_names += [n for n in executor.variables if n not in at_fork and n not in new_names]
        for name in new_names:
            self._parent[name] = [e.variables.get(name) for e in executors]


# ---- running programs ------------------------------------------------------------------------

async def arun_program(func: Callable[..., Any], backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any],
                       defaults: SglSamplingParams, stream: bool) -> AsyncProgramState:
    """Runs an async program function on a fresh state. Its own failures are recorded in the
    state (`state.error()`), not raised; cancelling the caller cancels the program."""
    executor = AsyncExecutor(backend, defaults, stream)
    executor.session_id = backend.session_id()
    state = AsyncProgramState(executor)

    async def body() -> None:
        try:
            state.ret_value = await func(state, *args, **kwargs)
            executor.end()
            await executor.done()
        except BaseException as e:
            executor.record_error(e)
            await asyncio.shield(executor.cancel())  # the branches' requests in flight are aborted
            executor.end()
            if not isinstance(e, Exception):
                raise  # cancellation (and interpreter exits) go on up
        finally:
            await _end_sessions(executor)

    if stream:
        executor.program_task = asyncio.get_running_loop().create_task(body())
    else:
        await body()
    return state


async def _end_sessions(executor: AsyncExecutor) -> None:
    """Tells the server the program's sessions ended; a failure only leaves them to expire."""
    for session_id in executor.sessions():
        try:
            await asyncio.shield(executor.backend.aend_session(session_id))
        except BaseException as e:  # a cancelled program still ends its sessions (shielded)
            logger.warning("could not end session %s: %r", session_id, e)


async def stream_batch(run_one: Callable[[dict[str, Any]], Any], items: list[dict[str, Any]],
                       max_concurrency: int) -> AsyncIterator[tuple[int, Any]]:
    """(index, state) for each item as its program finishes, at most `max_concurrency` running
    at once; stopping the iteration early cancels the programs still running."""
    running: dict[asyncio.Task, int] = {}
    next_item = 0
    try:
        while next_item < len(items) or running:
            while next_item < len(items) and len(running) < max_concurrency:
                running[asyncio.ensure_future(run_one(items[next_item]))] = next_item
                next_item += 1
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=running.__getitem__):
                yield running.pop(task), task.result()
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
