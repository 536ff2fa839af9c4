"""The interface between the interpreter and a model server, and the default backend.

A backend turns one `gen`/`select` of a program into calls on a server. Every call carries
the program's whole text (`Prompt.text`); the server's radix cache makes the part it has seen
before free. Chat-only APIs use `Prompt.messages` instead.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from .chat_template import ChatRenderer
from .choices import ChoiceDecision, ChoicesMethod
from .sampling import SglSamplingParams


class BackendError(RuntimeError):
    """A server refused or failed a request; the message is the server's."""


@dataclass(frozen=True)
class Prompt:
    text: str  # the program's whole text so far
    messages: tuple[dict[str, Any], ...] = ()  # complete chat turns so far
    role: str | None = None  # the open turn's role, if any
    role_content: str = ""  # the open turn's content so far
    lora_path: str | None = None  # the LoRA adapter this call runs on (None: the base model)
    session_id: str | None = None  # the running program's session on the server (docs/sessions.md)
    images: tuple[str, ...] = ()  # the text's images in order, as data URLs (one image token each)


@dataclass(frozen=True)
class Generation:
    texts: list[str]  # one per sample (n)
    meta_infos: list[dict[str, Any]] = field(default_factory=list)


class Backend(ABC):
    """`generate`, `generate_stream`, `select`, `cache_prefix`, `get_chat_template`, `flush_cache`."""

    @abstractmethod
    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation: ...

    @abstractmethod
    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta_info so far) until the generation ends."""

    @abstractmethod
    def select(self, prompt: Prompt, choices: list[str], temperature: float,
               method: ChoicesMethod) -> ChoiceDecision: ...

    def cache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        """Computes `text` (with its `images`) into the server's prefix cache without
        generating (a hint: may no-op)."""

    def image_token(self) -> str:
        """The text that stands for one image in a prompt; BackendError when the model takes none."""
        raise BackendError(f"image: {type(self).__name__} sends no images")

    @abstractmethod
    def get_chat_template(self) -> ChatRenderer: ...

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def end_session(self, session_id: str) -> None:
        """The program of `session_id` ended: the server may let its prefix go."""

    def session_id(self) -> str | None:
        """A new session id for a program about to run, or None: this backend keeps none."""
        return None

    # ---- asyncio (aio.py) ---------------------------------------------------------------------
    # By default each call runs the blocking one on a worker thread; RuntimeEndpoint talks
    # HTTP on the event loop itself.

    async def agenerate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        return await asyncio.to_thread(self.generate, prompt, params)

    async def agenerate_stream(self, prompt: Prompt,
                               params: SglSamplingParams) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        for chunk in await asyncio.to_thread(lambda: list(self.generate_stream(prompt, params))):
            yield chunk

    async def aselect(self, prompt: Prompt, choices: list[str], temperature: float,
                      method: ChoicesMethod) -> ChoiceDecision:
        return await asyncio.to_thread(self.select, prompt, choices, temperature, method)

    async def acache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        await asyncio.to_thread(self.cache_prefix, text, *((images,) if images else ()))

    async def aget_chat_template(self) -> ChatRenderer:
        return await asyncio.to_thread(self.get_chat_template)

    async def aend_session(self, session_id: str) -> None:
        await asyncio.to_thread(self.end_session, session_id)


_default: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Backend) -> None:
    """The backend `run`/`run_batch` use when none is passed."""
    global _default
    if not isinstance(backend, Backend):
        raise TypeError(f"set_default_backend: expected a backend (RuntimeEndpoint, Runtime, OpenAI), "
                        f"got {type(backend).__name__}")
    with _default_lock:
        _default = backend


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: Backend | None) -> Backend:
    chosen = backend if backend is not None else _default
    if chosen is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))")
    if not isinstance(chosen, Backend):
        raise TypeError(f"backend: expected a RuntimeEndpoint, Runtime or OpenAI, got {type(chosen).__name__}")
    return chosen


def flush_cache(backend: Backend | None = None) -> bool:
    """Empties the server's prefix cache; False when there is no backend or it cannot."""
    chosen = backend if backend is not None else _default
    return chosen.flush_cache() if chosen is not None else False


def get_server_info(backend: Backend | None = None) -> dict[str, Any]:
    chosen = backend if backend is not None else _default
    return chosen.get_server_info() if chosen is not None else {}
