"""One HTTP request's samples, run the same way for /generate, /v1/completions,
/v1/chat/completions and /v1/responses:

- admission: a request's samples are all taken or none is (429 when they would pass
  --max-queued-requests); they are registered with no await in between, so no other request
  takes a place meanwhile;
- prompt sharing: the samples of one prompt (under one cache salt) wait for one prefill of it,
  then hit the radix cache;
- the samples run concurrently and their chunks (results.py: what is new in each) come out in
  arrival order, tagged with the sample's index;
- closing the runner (the route finished or failed, or the client went away) aborts whatever
  still runs in the scheduler at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Coroutine, TypeVar

from fastapi import Request

from ..io_struct import TokenizedGenerateReq
from ..results import ResultBuilder
from .errors import InternalAbort, Overloaded
from .tokenizer_manager import TokenizerManager

T = TypeVar("T")


@dataclass(frozen=True)
class SampleEvent:
    """A sample's next chunk, or its failure (nothing more comes for it then)."""

    index: int
    chunk: dict[str, Any] | None = None
    error: Exception | None = None

    @property
    def ended(self) -> bool:  # the runner's own marker: the sample's stream is closed
        return self.chunk is None and self.error is None


class RequestRunner:
    """Runs the samples `open()` admitted; read `events()` or `chunks()`, then `close()`."""

    def __init__(self, tm: TokenizerManager, msgs: list[TokenizedGenerateReq], streams: list[Any]):
        self._tm = tm
        self._tasks: set[asyncio.Task] = set()
        # Streams no task has taken yet (a pump not started, or waiting for the shared prompt).
        self._unowned: list[Any] = list(streams)
        # Bounded: a slow reader leaves chunks in the tokenizer manager, which merges them.
        self._queue: asyncio.Queue[SampleEvent] = asyncio.Queue(maxsize=max(1, len(msgs)))
        self._count = len(msgs)
        self._open = len(msgs)  # samples whose stream has not ended yet
        shared: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}
        for index, msg in enumerate(msgs):  # the salt is part of the key: a prompt is cached per salt
            shared.setdefault((msg.cache_salt, msg.lora_path, tuple(msg.input_ids)), []).append(index)
        for indices in shared.values():
            samples = [(i, streams[i]) for i in indices]
            if len(samples) > 1:
                self._spawn(self._share_prompt(msgs[indices[0]], samples))
            else:
                self._spawn(self._pump(*samples[0]))

    @classmethod
    async def open(cls, tm: TokenizerManager, msgs: list[TokenizedGenerateReq],
                   text_in_logprobs: bool = False) -> RequestRunner:
        """Admits and starts every message of one HTTP request, or none of them: raises
        Overloaded (counted as queue_full) when they would pass the server's limit, and what
        `tm.generate` raises (ValueError, ServerUnavailable) with nothing left registered."""
        if tm.is_full(len(msgs)):
            tm.metrics.on_rejected("queue_full")
            raise Overloaded(f"{len(msgs)} more requests would pass the server's limit "
                             "(--max-queued-requests); retry later")
        streams: list[Any] = []
        try:
            for msg in msgs:  # no await in this loop: the places checked above stay free
                streams.append(tm.generate(msg, text_in_logprobs))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return cls(tm, msgs, streams)

    def follow(self, index: int, msg: TokenizedGenerateReq) -> None:
        """Runs `msg` as a later phase of sample `index`, in the place the sample was admitted
        to (its earlier phase has finished); its chunks come out under the same index."""
        stream = self._tm.generate(msg, admitted=True)
        self._unowned.append(stream)
        self._open += 1
        self._spawn(self._pump(index, stream))

    async def events(self) -> AsyncIterator[SampleEvent]:
        """Every sample's chunks and failures, as they come, until all samples ended."""
        while self._open:
            event = await self._queue.get()
            if event.ended:
                self._open -= 1
            else:
                yield event

    async def chunks(self, raise_internal_aborts: bool = True) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(sample index, chunk) as they come. Raises a failed sample's error and, unless told
        not to, InternalAbort for a request the scheduler ended on an internal error (an abort
        with a message; the native API returns it as a finish reason)."""
        async for event in self.events():
            if event.error is not None:
                raise event.error
            reason = event.chunk["meta_info"].get("finish_reason") or {}
            if raise_internal_aborts and reason.get("type") == "abort" and reason.get("message"):
                raise InternalAbort(reason["message"])
            yield event.index, event.chunk

    async def whole_results(self, raise_internal_aborts: bool = True) -> list[dict[str, Any]]:
        """Each sample's whole result, in sample order, once all ended; raises as chunks() does."""
        wholes = [ResultBuilder() for _ in range(self._count)]
        async for index, chunk in self.chunks(raise_internal_aborts):
            wholes[index].add(chunk)
        return [w.result() for w in wholes]

    async def close(self) -> None:
        """Stops every sample; those still running are aborted in the scheduler (by their own
        tasks, so that a cancelled caller, e.g. a stream whose client left, cannot cut that
        short). Idempotent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        unowned, self._unowned = self._unowned, []
        for stream in unowned:  # never sent: closing them does not wait for anything
            await stream.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- inside ------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _share_prompt(self, msg: TokenizedGenerateReq, samples: list[tuple[int, Any]]) -> None:
        try:
            await self._tm.cache_prompt(msg)
        except Exception as e:
            for index, stream in samples:
                self._unowned.remove(stream)
                await stream.aclose()
                await self._queue.put(SampleEvent(index, error=e))
                await self._queue.put(SampleEvent(index))
            return
        for index, stream in samples:
            self._spawn(self._pump(index, stream))

    async def _pump(self, index: int, stream: Any) -> None:
        self._unowned.remove(stream)
        try:
            async for chunk in stream:
                await self._queue.put(SampleEvent(index, chunk=chunk))
        except Exception as e:  # the sample fails alone; the route decides what that means
            await self._queue.put(SampleEvent(index, error=e))
        finally:
            await stream.aclose()
        await self._queue.put(SampleEvent(index))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client went away first; `work` is cancelled then.
    For requests not streamed (EventStream notices a streaming client leave)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        return job.result() if job.done() else None
    finally:
        job.cancel()
        gone.cancel()
        await asyncio.gather(job, gone, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns once the ASGI server reports the client gone (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
