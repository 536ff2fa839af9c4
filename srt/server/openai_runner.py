"""Running an OpenAI request's samples: a job holds each prompt's samples (as the intake built
them), the runner drives them concurrently through the TokenizerManager and hands results out
by choice index, aborting whatever still runs when it is closed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

from fastapi import Request

from ..io_struct import TokenizedGenerateReq
from .tokenizer_manager import TokenizerManager

_DONE = object()  # a sample's end marker in SampleRunner's queue


@dataclass
class Job:
    """A request turned into samples: groups[p] holds prompt p's n samples, in choice order."""

    groups: list[list[TokenizedGenerateReq]]
    echo_texts: list[str]
    renames: dict[str, str]  # intake field name -> this request's field name

    @property
    def num_choices(self) -> int:
        return sum(len(g) for g in self.groups)

    def usage(self, finals: list[dict[str, Any]]) -> dict[str, Any]:
        metas = [f["meta_info"] for f in finals]
        completion = sum(m["completion_tokens"] for m in metas)
        cached, i = 0, 0
        for group in self.groups:  # later samples of a prompt hit the cache its first prefill filled
            cached += min(m["cached_tokens"] for m in metas[i:i + len(group)])
            i += len(group)
        prompt = sum(len(g[0].input_ids) for g in self.groups)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class SampleRunner:
    """Runs every sample of a job concurrently and hands out (choice index, result) as they come.

    Samples of one prompt share its KV: the prompt is prefilled once (`cache_prompt`), then the
    samples run and hit the radix cache. `close()` cancels whatever still runs; cancelling a
    sample's task closes its TokenizerManager generator, which aborts the request in the scheduler.
    """

    def __init__(self, tm: TokenizerManager, job: Job):
        self._tm = tm
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._remaining = job.num_choices
        first = 0
        for group in job.groups:
            self._spawn(self._run_group(first, group))
            first += len(group)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, first: int, group: list[TokenizedGenerateReq]) -> None:
        if len(group) > 1:
            try:
                await self._tm.cache_prompt(group[0])
            except Exception as e:
                self._queue.put_nowait((first, e))
                return
        for i, msg in enumerate(group):
            self._spawn(self._run_one(first + i, msg))

    async def _run_one(self, index: int, msg: TokenizedGenerateReq) -> None:
        results = self._tm.generate(msg)
        try:
            async for out in results:
                reason = out["meta_info"].get("finish_reason") or {}
                if reason.get("type") == "abort" and reason.get("message"):
                    raise InternalAbort(reason["message"])  # the scheduler failed it, not the client
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, _DONE))
        except Exception as e:
            self._queue.put_nowait((index, e))
        finally:
            await results.aclose()

    async def next_output(self) -> tuple[int, dict[str, Any]] | None:
        """The next result, or None once every sample finished; raises a sample's exception."""
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    async def outputs(self) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """next_output's results until every sample finished; closing it aborts what still runs."""
        try:
            while (item := await self.next_output()) is not None:
                yield item
        finally:
            self.close()

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class InternalAbort(Exception):
    """The scheduler ended a request on an internal error (an abort with a message)."""


async def call_on_disconnect(request: Request, callback: Callable[[], None]) -> None:
    """Waits for the client to go away (reads the ASGI receive channel until it says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    callback()
