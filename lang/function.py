"""`@function`: a program, run once (`run`), over many inputs (`run_batch`), or traced."""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

from .backend import Backend, get_default_backend, resolve_backend
from .interpreter import StreamExecutor
from .sampling import SglSamplingParams
from .state import ProgramState
from .tracer import TraceResult, trace_program

logger = logging.getLogger(__name__)

# A traced prefix shorter than this is not worth a separate warm-up request.
_MIN_WARM_PREFIX_CHARS = 64


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
        with `stream=True` returns at once (errors: `s.error()`, or raised by readers)."""
        program_kwargs, defaults = self._split_kwargs(kwargs, "run")
        state = run_program(self, resolve_backend(backend), args, program_kwargs, defaults, stream)
        if not stream and state._executor.error_ is not None:
            raise state._executor.error_
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per dict of arguments, concurrently; results in input order. A
        program that fails does not stop the others: its state's `error()` holds the exception."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts of arguments")
        items = [self._batch_item(i, item) for i, item in enumerate(batch_kwargs)]
        defaults = SglSamplingParams.from_kwargs(sampling, "run_batch")
        chosen = resolve_backend(backend)
        if len(items) > 1:
            self.cache(chosen)
        threads = _thread_count(num_threads, len(items))
        runs = _BatchRunner(self, chosen, items, defaults, threads, progress_bar)
        return runs.iterate() if generator_style else list(runs.iterate())

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

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

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
    state = ProgramState(executor)
    merged = {**program.bind_arguments, **kwargs}

    def body() -> None:
        try:
            state.ret_value = program.func(state, *args, **merged)
        except BaseException as e:
            executor.record_error(e)
        finally:
            executor.end()

    if stream:
        executor.program_thread = threading.Thread(target=body, name="radixlm-stream-program", daemon=True)
        executor.program_thread.start()
        return state
    executor.program_thread = threading.current_thread()
    body()
    executor.wait_finished()
    return state


def _endpoint_of(backend: Backend) -> Backend:
    # A Runtime delegates to its endpoint; talking to the endpoint directly skips a hop.
    return getattr(backend, "endpoint", None) or backend


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
