"""SGLang's native /generate: the body checked and tokenized (off the event loop: a long prompt
takes seconds to tokenize and would stall every other client), run whole or streamed as SSE."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response

from ..intake import Intake
from ..io_struct import TokenizedGenerateReq
from .errors import Overloaded, ServerUnavailable, error_body, error_response, status_of
from .streaming import SSE_DONE, EventStream, sse
from .tokenizer_manager import TokenizerManager

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "cache_salt"}
_BOOL_FIELDS = ("stream", "return_text_in_logprobs")


def field_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about: 'sampling_params.top_p: ...'."""
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


def error_for(e: Exception) -> Response:
    return error_response(status_of(e), str(e), field_of(str(e)) if isinstance(e, ValueError) else None)


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return error_response(400, f"body: malformed JSON: {e}")


async def generate(tm: TokenizerManager, request: Request) -> Response:
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    try:
        msgs, batched = await asyncio.to_thread(generate_requests, body, tm.intake)
        if tm.is_full(len(msgs)):  # a batch is admitted whole or not at all
            tm.metrics.on_rejected("queue_full")
            raise Overloaded(f"{len(msgs)} more requests would pass the server's limit "
                             "(--max-queued-requests); retry later")
    except (ValueError, Overloaded) as e:
        return error_for(e)
    with_text = body.get("return_text_in_logprobs", False)
    if body.get("stream", False):
        return EventStream(_stream(tm, msgs, with_text))
    try:
        results = await _run_until_done_or_disconnect(tm, msgs, with_text, request)
    except (ValueError, Overloaded, ServerUnavailable) as e:
        return error_for(e)
    if results is None:
        return Response(status_code=499)
    return Response(orjson.dumps(results if batched else results[0]), media_type="application/json")


def generate_requests(body: Any, intake: Intake) -> tuple[list[TokenizedGenerateReq], bool]:
    """SGLang's /generate body -> one message per prompt and sample, all validated."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field")
    for name in _BOOL_FIELDS:  # "stream": "no" must not stream
        if not isinstance(body.get(name, False), bool):
            raise ValueError(f"{name}: must be a boolean")
    batched, groups = intake.batch(
        body.get("text"), body.get("input_ids"), body.get("sampling_params"), body.get("rid"),
        return_logprob=body.get("return_logprob", False), logprob_start_len=body.get("logprob_start_len"),
        top_logprobs_num=body.get("top_logprobs_num"), stream=body.get("stream", False),
        cache_salt=body.get("cache_salt"))
    msgs = [m for group in groups for m in group]
    return msgs, batched or len(msgs) > 1


async def _run_until_done_or_disconnect(tm: TokenizerManager, msgs: list[TokenizedGenerateReq], with_text: bool,
                                        request: Request) -> list[dict[str, Any]] | None:
    """Runs all requests; if the client disconnects first, aborts them and returns None. If one
    fails, the others are aborted and its exception raised."""
    await _share_prompts(tm, msgs)
    tasks = [asyncio.ensure_future(tm.generate_once(m, with_text)) for m in msgs]
    work = asyncio.gather(*tasks)
    try:
        while not work.done():
            done, _ = await asyncio.wait({work}, timeout=0.5)
            if not done and await request.is_disconnected():
                return None
        return work.result()
    finally:
        for task in tasks:  # cancelling closes the generators, which abort in the scheduler
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _share_prompts(tm: TokenizerManager, msgs: list[TokenizedGenerateReq]) -> None:
    """Several samples of one prompt: prefill it once so the others hit the radix cache."""
    groups: dict[Any, list[TokenizedGenerateReq]] = {}
    for m in msgs:  # the salt is part of the key: a prompt is cached per salt
        groups.setdefault((m.cache_salt, tuple(m.input_ids)), []).append(m)
    await asyncio.gather(*(tm.cache_prompt(g[0]) for g in groups.values() if len(g) > 1))


async def _stream(tm: TokenizerManager, msgs: list[TokenizedGenerateReq], with_text: bool) -> AsyncIterator[bytes]:
    """SSE: `data: {...}` per chunk (with "index" when several requests), then `data: [DONE]`.
    A request that fails (bad input found late, a dead child, shutdown) sends `data: {"error":
    ...}` in its place, so a stream never just stops."""
    tasks: list[asyncio.Future] = []
    try:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, msg: TokenizedGenerateReq) -> None:
            try:
                async for chunk in tm.generate(msg, with_text):
                    await queue.put((index, chunk))
            except (ValueError, Overloaded, ServerUnavailable) as e:
                await queue.put((index, error_body(status_of(e), str(e))))
            finally:
                await queue.put((index, None))

        try:
            await _share_prompts(tm, msgs)
        except (ValueError, Overloaded, ServerUnavailable) as e:
            yield sse(error_body(status_of(e), str(e)))
            yield SSE_DONE
            return
        tasks = [asyncio.ensure_future(pump(i, m)) for i, m in enumerate(msgs)]
        remaining = len(tasks)
        while remaining:
            index, chunk = await queue.get()
            if chunk is None:
                remaining -= 1
                continue
            if len(msgs) > 1:
                chunk = {**chunk, "index": index}
            yield sse(chunk)
        yield SSE_DONE
    finally:
        for task in tasks:  # the client left: cancelling closes the generators, which abort
            task.cancel()
