"""SGLang's native /generate: the body checked and tokenized, its images decoded (off the event
loop: a long prompt takes seconds to tokenize, an image to decode, and either would stall every
other client), run by the request runner, answered whole or streamed as SSE."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response

from ..intake import Intake
from ..io_struct import TokenizedGenerateReq
from .errors import Overloaded, ServerUnavailable, error_body, error_response, status_of
from .native_stream import CumulativeStream
from .request_runner import RequestRunner, unless_disconnected
from .streaming import SSE_DONE, EventStream, sse
from .tokenizer_manager import TokenizerManager

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "cache_salt",
                   "lora_path", "session_id", "image_data"}
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


async def json_object_body(request: Request) -> dict | Response:
    """The body as a JSON object, or the 400 response saying why it is not one."""
    body = await json_body(request)
    if isinstance(body, Response) or isinstance(body, dict):
        return body
    return error_response(400, "body: must be a JSON object")


async def generate(tm: TokenizerManager, request: Request, incremental: bool = False) -> Response:
    """incremental: stream events hold what is new since the one before (--incremental-streaming-
    output), not everything so far."""
    body = await json_body(request)
    if isinstance(body, Response):
        return body
    try:
        msgs, batched = await asyncio.to_thread(generate_requests, body, tm.intake)
    except ValueError as e:
        return error_for(e)
    with_text = body.get("return_text_in_logprobs", False)
    stream = body.get("stream", False)
    try:
        runner = await RequestRunner.open(tm, msgs, with_text)
    except Overloaded as e:  # a batch is admitted whole or not at all
        return error_for(e)
    except (ValueError, ServerUnavailable) as e:
        return EventStream(_failed(e)) if stream else error_for(e)
    if stream:
        return EventStream(_stream(runner, len(msgs), incremental), on_close=runner.close)
    try:
        results = await unless_disconnected(request, runner.whole_results(raise_internal_aborts=False))
    except (ValueError, ServerUnavailable) as e:
        return error_for(e)
    finally:
        await runner.close()
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
        cache_salt=body.get("cache_salt"), lora_path=body.get("lora_path"), session_id=body.get("session_id"),
        image_data=body.get("image_data"))
    msgs = [m for group in groups for m in group]
    return msgs, batched or len(msgs) > 1


async def _stream(runner: RequestRunner, count: int, incremental: bool) -> AsyncIterator[bytes]:
    """SSE: `data: {...}` per chunk (with "index" when several requests), then `data: [DONE]`;
    each event holds everything so far, or with `incremental` what is new in it. A request that
    fails (bad input found late, a dead child, shutdown) sends `data: {"error": ...}` in its
    place, so a stream never just stops."""
    streams = [CumulativeStream(i if count > 1 else None) for i in range(count)]
    try:
        async for event in runner.events():
            if event.error is not None:
                error = error_body(status_of(event.error), str(event.error))
                yield sse({**error, "index": event.index} if count > 1 else error)
            elif incremental:
                yield sse(event.chunk if count == 1 else {**event.chunk, "index": event.index})
            else:
                yield streams[event.index].event(event.chunk)
        yield SSE_DONE
    finally:  # the client left, or the stream ended: nothing may keep running
        await runner.close()


async def _failed(e: Exception) -> AsyncIterator[bytes]:
    yield sse(error_body(status_of(e), str(e)))
    yield SSE_DONE
