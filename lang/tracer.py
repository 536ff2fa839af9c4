"""Tracing: run a program without a model to find the text it starts with.

The program runs on a state whose backend stops at the first `gen`/`select`/fork, with every
argument replaced by a placeholder that stops the trace as soon as it is used. What was added
until then is the program's constant prefix: the same for every input, so `run_batch`
computes it into the server's cache once before fanning out.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .backend import Backend, Generation, Prompt
from .chat_template import ChatRenderer
from .choices import ChoiceDecision, ChoicesMethod
from .interpreter import StreamExecutor
from .sampling import SglSamplingParams
from .state import ProgramState

logger = logging.getLogger(__name__)


class _StopTrace(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Placeholder:
    """Stands for an argument whose value is not known while tracing; any use stops the trace."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise _StopTrace(f"argument {self._name!r} was used")

    __str__ = __format__ = __add__ = __radd__ = __len__ = __iter__ = __getitem__ = __bool__ = _stop
    __eq__ = __int__ = __float__ = __contains__ = __call__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        raise _StopTrace(f"argument {self._name!r} was used")

    def __repr__(self) -> str:
        return f"Placeholder({self._name})"


class _TracingBackend(Backend):
    """Stops at anything needing the model; chat templates come from the real backend."""

    def __init__(self, real: Backend | None):
        self._real = real

    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        raise _StopTrace("gen")

    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        raise _StopTrace("gen")

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoiceDecision:
        raise _StopTrace("select")

    def cache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        raise _StopTrace("fork")

    def get_chat_template(self) -> ChatRenderer:
        if self._real is None:
            raise _StopTrace("a role (no backend to render it)")
        return self._real.get_chat_template()

    def get_model_info(self) -> dict[str, Any]:
        """A gen with tools renders the text again with them before it stops the trace."""
        info = getattr(self._real, "get_model_info", None)
        if info is None:
            raise _StopTrace("gen")
        return info()


@dataclass(frozen=True)
class TraceResult:
    prefix: str  # the text every run of the program starts with
    stopped_by: str  # what ended the trace: "gen", "select", "fork", "argument 'x' was used", ...
    messages: list[dict[str, Any]] = field(default_factory=list)  # complete turns in the prefix


def trace_program(func: Callable[..., Any], backend: Backend | None, bound: dict[str, Any]) -> TraceResult:
    executor = StreamExecutor(_TracingBackend(backend), SglSamplingParams(), threaded=False)
    state = ProgramState(executor)
    names = list(inspect.signature(func).parameters)[1:]
    kwargs = {n: bound[n] if n in bound else Placeholder(n) for n in names}
    reason = "end of program"
    try:
        func(state, **kwargs)
    except _StopTrace as e:
        reason = e.reason
    except Exception as e:  # the program needed a real value in some other way
        reason = f"{type(e).__name__}: {e}"
        logger.debug("trace stopped by %s", reason)
    return TraceResult(executor.text_, reason, list(executor.messages_))
