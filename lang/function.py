"""`@function`: a program, run once (`run`), over many inputs (`run_batch`), or traced."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator

from .backend import Backend, get_default_backend, resolve_backend
from .interpreter import StreamExecutor
from .sampling import SglSamplingParams
from .state import ProgramState
from .tracer import TraceResult, trace_program

logger = logging.getLogger(__name__)

# A traced prefix shorter than this is not worth a separate warm-up request.
_MIN_WARM_PREFIX_CHARS = 64
# Async batches: programs running at once unless the caller says (each holds one connection).
_DEFAULT_MAX_CONCURRENCY = 512


class SglFunction:
    """A program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state `s`")
        self.func = func
        self.arg_names = [p.name for p in params[1:]]
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        self.is_async = inspect.iscoroutinefunction(func)  # an `async def` program (aio.py)

    def bind(self, **kwargs: Any) -> "SglFunction":
        """A copy with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}.bind() got unexpected keyword arguments {unknown}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Runs the program. Keywords that are the program's parameters go to it; the others are
        sampling parameters (max_new_tokens, temperature, stop, ...) for every gen in it, which a
        gen's own values override. Raises the first error (a failed gen: the server's message);
        with `stream=True` returns at once (errors: `s.error()`, or raised by readers). An
        async program runs on an event loop of its own (in async code: `await prog.arun()`)."""
        if self.is_async:
            _no_running_loop(f"{self.__name__}.run", f"await {self.__name__}.arun(...)")
            return asyncio.run(self.arun(*args, stream=stream, backend=backend, **kwargs))
        program_kwargs, defaults = self._split_kwargs(kwargs, "run")
        state = run_program(self, resolve_backend(backend), args, program_kwargs, defaults, stream)
        if not stream and state._executor.error_ is not None:
            raise state._executor.error_
        return state

    async def arun(self, *args: Any, stream: bool = False, backend: Backend | None = None,
                   **kwargs: Any) -> ProgramState:
        """`run` for asyncio code. An async program runs on this event loop (cancelling the
        awaiting task aborts its requests on the server); a sync one on a worker thread."""
        if not self.is_async:
            return await asyncio.to_thread(self.run, *args, stream=stream, backend=backend, **kwargs)
        from .aio import arun_program

        program_kwargs, defaults = self._split_kwargs(kwargs, "arun")
        state = await arun_program(self.func, _endpoint_of(resolve_backend(backend)), args,
                                   {**self.bind_arguments, **program_kwargs}, defaults, stream)
        if not stream and state._executor.error_ is not None:
            raise state._executor.error_
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                  num_threads: int | str = "auto", max_concurrency: int | None = None, progress_bar: bool = False,
                  generator_style: bool = False, **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per dict of arguments, at most `max_concurrency` at once
        (sync programs: `num_threads` threads, the same bound); results in input order. A
        program that fails does not stop the others: its state's `error()` holds the exception."""
        items, defaults, chosen = self._batch_setup(batch_kwargs, sampling, backend, "run_batch")
        if self.is_async:
            _no_running_loop(f"{self.__name__}.run_batch", f"await {self.__name__}.arun_batch(...)")
            states = asyncio.run(self._gather(items, defaults, chosen, max_concurrency))
            return iter(states) if generator_style else states
        if len(items) > 1:
            self.cache(chosen)
        threads = (_thread_count(num_threads, len(items)) if max_concurrency is None
                   else _concurrency(max_concurrency, len(items)))
        runs = _BatchRunner(self, chosen, items, defaults, threads, progress_bar)
        return runs.iterate() if generator_style else list(runs.iterate())

    async def arun_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                         max_concurrency: int | None = None, **sampling: Any) -> list[ProgramState]:
        """`run_batch` for asyncio code: the states in input order."""
        items, defaults, chosen = self._batch_setup(batch_kwargs, sampling, backend, "arun_batch")
        return await self._gather(items, defaults, chosen, max_concurrency)

    async def run_batch_stream(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                               max_concurrency: int | None = None,
                               **sampling: Any) -> AsyncIterator[tuple[int, ProgramState]]:
        """`async for i, state in prog.run_batch_stream(args)`: each state as its program
        finishes, with its index in `batch_kwargs`. Leaving the loop early cancels the
        programs still running (their requests are aborted)."""
        from .aio import stream_batch

        items, defaults, chosen = self._batch_setup(batch_kwargs, sampling, backend, "run_batch_stream")
        async for index, state in stream_batch(self._batch_runner(defaults, chosen), items,
                                               _concurrency(max_concurrency, len(items))):
            yield index, state

    async def _gather(self, items: list[dict[str, Any]], defaults: SglSamplingParams, backend: Backend,
                      max_concurrency: int | None) -> list[ProgramState]:
        from .aio import stream_batch

        states: list[Any] = [None] * len(items)
        async for index, state in stream_batch(self._batch_runner(defaults, backend), items,
                                               _concurrency(max_concurrency, len(items))):
            states[index] = state
        return states

    def _batch_runner(self, defaults: SglSamplingParams, backend: Backend) -> Callable[[dict[str, Any]], Any]:
        """One batch item's run as a coroutine: on the loop for an async program, on a worker
        thread for a sync one. Failures stay in the state."""
        endpoint = _endpoint_of(backend)
        if self.is_async:
            from .aio import arun_program

            return lambda item: arun_program(self.func, endpoint, (), {**self.bind_arguments, **item}, defaults, False)
        return lambda item: asyncio.to_thread(run_program, self, endpoint, (), item, defaults, False)

    def _batch_setup(self, batch_kwargs: Any, sampling: dict[str, Any], backend: Backend | None,
                     where: str) -> tuple[list[dict[str, Any]], SglSamplingParams, Backend]:
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"{where}: batch_kwargs must be a list of dicts of arguments")
        items = [self._batch_item(i, item) for i, item in enumerate(batch_kwargs)]
        return items, SglSamplingParams.from_kwargs(sampling, where), resolve_backend(backend)

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> TraceResult:
        """Runs the program without the model up to its first gen/select/fork or use of an
        argument not given here; returns the constant text it starts with."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}.trace() got unexpected keyword arguments {unknown}")
        chosen = backend if backend is not None else get_default_backend()  # None: roles stop the trace
        return trace_program(self.func, chosen, {**self.bind_arguments, **kwargs})

    def cache(self, backend: Backend | None = None) -> str:
        """Computes the program's constant prefix into the server's cache; returns the prefix."""
        chosen = resolve_backend(backend)
        try:
            prefix = self.trace(backend=chosen).prefix
            if len(prefix) >= _MIN_WARM_PREFIX_CHARS:
                chosen.cache_prefix(prefix)
        except Exception as e:  # warming is an optimization; the programs themselves report real errors
            logger.warning("no cache warm-up for %s: %s", self.__name__, e)
            return ""
        return prefix

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`run`; for an async program, `arun` (to await)."""
        return self.arun(*args, **kwargs) if self.is_async else self.run(*args, **kwargs)

    def _split_kwargs(self, kwargs: dict[str, Any], where: str) -> tuple[dict[str, Any], SglSamplingParams]:
        program = {k: v for k, v in kwargs.items() if k in self.arg_names}
        sampling = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        return program, SglSamplingParams.from_kwargs(sampling, f"{self.__name__}.{where}")

    def _batch_item(self, index: int, item: Any) -> dict[str, Any]:
        if isinstance(item, (list, tuple)):  # positional arguments
            if len(item) > len(self.arg_names):
                raise TypeError(f"run_batch: item {index} has {len(item)} arguments; the program takes "
                                f"{len(self.arg_names)}")
            item = dict(zip(self.arg_names, item))
        if not isinstance(item, dict):
            raise TypeError(f"run_batch: item {index} must be a dict of arguments, got {type(item).__name__}")
        unknown = sorted(set(item) - set(self.arg_names))
        if unknown:
            raise TypeError(f"run_batch: item {index} has unknown arguments {unknown}")
        return item


def function(func: Callable[..., Any] | None = None, **_ignored: Any) -> Any:
    """Decorator: `@function` or `@function()` (SGLang's extra options are accepted and ignored)."""
    if func is not None:
        return SglFunction(func)
    return SglFunction


def run_program(program: SglFunction, backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any],
                defaults: SglSamplingParams, stream: bool) -> ProgramState:
    """Runs the program function on a fresh state. Never raises for the program's own failures:
    they are recorded in the state (`state.error()`)."""
    executor = StreamExecutor(_endpoint_of(backend), defaults, stream)
    executor.session_id = executor.backend.session_id()
    state = ProgramState(executor)
    merged = {**program.bind_arguments, **kwargs}

    def body() -> None:
        try:
            state.ret_value = program.func(state, *args, **merged)
        except BaseException as e:
            executor.record_error(e)
        finally:
            executor.end()
            if executor.session_id is not None:
                executor.wait_finished()
                end_sessions(executor)

    if stream:
        executor.program_thread = threading.Thread(target=body, name="radixlm-stream-program", daemon=True)
        executor.program_thread.start()
        return state
    executor.program_thread = threading.current_thread()
    body()
    executor.wait_finished()
    return state


def end_sessions(executor: StreamExecutor) -> None:
    """Tells the server the program's sessions ended (a failure to say so only leaves them to
    expire: the program's own result stands)."""
    for child in executor.children:  # a branch's last call finishes before its session ends
        child.wait_finished()
    for session_id in executor.sessions():
        try:
            executor.backend.end_session(session_id)
        except Exception as e:
            logger.warning("could not end session %s: %s", session_id, e)


def _endpoint_of(backend: Backend) -> Backend:
    # A Runtime delegates to its endpoint; talking to the endpoint directly skips a hop.
    return getattr(backend, "endpoint", None) or backend


def _no_running_loop(call: str, instead: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{call}() blocks, and this thread runs an event loop: use `{instead}`")


def _concurrency(max_concurrency: int | None, num_items: int) -> int:
    if max_concurrency is None:
        max_concurrency = _DEFAULT_MAX_CONCURRENCY
    if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be an integer >= 1, got {max_concurrency!r}")
    return max(1, min(max_concurrency, num_items))


def _thread_count(num_threads: int | str, num_items: int) -> int:
    if num_threads == "auto":
        num_threads = max(64, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"run_batch: num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return max(1, min(num_threads, num_items))


class _BatchRunner:
    """Runs items on a thread pool, keeping a bounded window in flight, yielding in input order."""

    def __init__(self, program: SglFunction, backend: Backend, items: list[dict[str, Any]],
                 defaults: SglSamplingParams, threads: int, progress_bar: bool):
        self._program, self._backend, self._items = program, backend, items
        self._defaults, self._threads, self._progress_bar = defaults, threads, progress_bar

    def iterate(self) -> Iterator[ProgramState]:
        if not self._items:
            return
        bar = None
        if self._progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(self._items), desc=self._program.__name__)
        window = self._threads * 2
        with ThreadPoolExecutor(self._threads, thread_name_prefix="radixlm-batch") as pool:
            inflight: deque[Future] = deque()
            next_item = 0
            try:
                while next_item < len(self._items) or inflight:
                    while next_item < len(self._items) and len(inflight) < window:
                        future = pool.submit(run_program, self._program, self._backend, (),
                                             self._items[next_item], self._defaults, False)
                        if bar is not None:
                            future.add_done_callback(lambda _: bar.update(1))
                        inflight.append(future)
                        next_item += 1
                    yield inflight.popleft().result()
            finally:
                for future in inflight:  # the consumer stopped early
                    future.cancel()
                if bar is not None:
                    bar.close()
