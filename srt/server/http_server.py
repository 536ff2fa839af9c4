"""The HTTP front: SGLang's native API (/generate and friends), health, metrics, API keys.
The OpenAI routes live in openai_api.py."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.srt.intake import Intake
from radixlm.srt.io_struct import TokenizedGenerateReq
from radixlm.srt.server.streaming import SSE_DONE, EventStream, sse
from radixlm.srt.server.tokenize_routes import add_tokenize_routes
from radixlm.srt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 32 * 2**20
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_OPEN_PATHS = {"/health"}  # reachable without the API key (load balancers probe it)
_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "cache_salt"}


class ServerState:
    """What the handlers share: the tokenizer manager and whether the children are alive."""

    def __init__(self, tm: TokenizerManager, model_path: str, server_args: dict[str, Any]):
        self.tm = tm
        self.model_path = model_path
        self.server_args = server_args
        self.healthy = True
        self.unhealthy_reason = ""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": param, "code": status}}, status_code=status)


def field_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about: 'sampling_params.top_p: ...'."""
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """API key and body-size checks as a plain ASGI middleware. (Starlette's BaseHTTPMiddleware
    would hide client disconnects from the handlers, which abort requests on them.)"""

    def __init__(self, app: Any, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            return await error_response(413, f"request body over {MAX_REQUEST_BYTES} bytes")(scope, receive, send)
        if self.expected and scope["path"] not in _OPEN_PATHS and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await error_response(401, "missing or wrong API key (Authorization: Bearer <key>)")(
                scope, receive, send)
        received = 0
        started = False

        async def counting_receive() -> Any:  # a chunked body has no content-length to check
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_REQUEST_BYTES:
                raise _BodyTooLarge()
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await error_response(413, f"request body over {MAX_REQUEST_BYTES} bytes")(scope, receive, send)


def create_app(state: ServerState, api_key: str | None) -> FastAPI:
    app = FastAPI(title="radixlm", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(_Guard, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not state.healthy:
            return error_response(503, f"unhealthy: {state.unhealthy_reason}")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not state.healthy:
            return error_response(503, f"unhealthy: {state.unhealthy_reason}")
        try:
            probe = state.tm.intake.samples([0], {"max_new_tokens": 1, "temperature": 0})[0]
            await asyncio.wait_for(state.tm.generate_once(probe), timeout=60)
        except Exception as e:
            return error_response(503, f"generation failed: {e}")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        tok = state.tm.tokenizer
        # The chat template and special tokens let a client without the tokenizer render roles
        # exactly as /v1/chat/completions does.
        special = {name: value for name in _SPECIAL_TOKEN_NAMES if isinstance(value := getattr(tok, name, None), str)}
        return {"model_path": state.model_path, "tokenizer_path": state.server_args.get("tokenizer_path"),
                "is_generation": True, "context_length": state.tm.context_len,
                "vocab_size": state.tm.model_config.vocab_size,
                "chat_template": getattr(tok, "chat_template", None), "special_tokens": special}

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        reply = await state.tm.control("server_info")
        public_args = {k: v for k, v in state.server_args.items() if k != "api_key"}
        return {**public_args, **reply.data, "num_active_requests_main": state.tm.num_active}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        reply = await state.tm.control("flush_cache")
        if not reply.ok:
            return error_response(400, f"cache not flushed: {reply.data.get('message', '')}")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return error_response(400, "rid: must be a string", "rid")
        await state.tm.abort(rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            reply = await state.tm.control("server_info", timeout=5)
            state.tm.metrics.update_from_server_info(reply.data)
        except asyncio.TimeoutError:
            pass
        return Response(state.tm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        try:
            msgs, batched = _generate_requests(body, state.tm.intake)
        except ValueError as e:
            return error_response(400, str(e), field_of(str(e)))
        with_text = bool(body.get("return_text_in_logprobs", False))
        if body.get("stream"):
            return EventStream(_stream_generate(state.tm, msgs, with_text))
        try:
            results = await _run_until_done_or_disconnect(state.tm, msgs, with_text, request)
        except ValueError as e:
            return error_response(400, str(e), field_of(str(e)))
        if results is None:
            return Response(status_code=499)
        return _json(results if batched else results[0])

    add_tokenize_routes(app, state)
    return app


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return error_response(400, f"body: malformed JSON: {e}")


def _generate_requests(body: Any, intake: Intake) -> tuple[list[TokenizedGenerateReq], bool]:
    """SGLang's /generate body -> one message per prompt and sample, all validated."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    unknown = sorted(set(body) - _GENERATE_FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field")
    batched, groups = intake.batch(
        body.get("text"), body.get("input_ids"), body.get("sampling_params"), body.get("rid"),
        return_logprob=body.get("return_logprob", False), logprob_start_len=body.get("logprob_start_len"),
        top_logprobs_num=body.get("top_logprobs_num"), stream=bool(body.get("stream", False)),
        cache_salt=body.get("cache_salt"))
    msgs = [m for group in groups for m in group]
    return msgs, batched or len(msgs) > 1


async def _run_until_done_or_disconnect(tm: TokenizerManager, msgs: list[TokenizedGenerateReq], with_text: bool,
                                        request: Request) -> list[dict[str, Any]] | None:
    """Runs all requests; if the client disconnects first, aborts them and returns None."""
    await _share_prompts(tm, msgs)
    work = asyncio.ensure_future(asyncio.gather(*(tm.generate_once(m, with_text) for m in msgs)))
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=0.5)
        if not done and await request.is_disconnected():
            work.cancel()  # closing the generators aborts the requests in the scheduler
            try:
                await work
            except (asyncio.CancelledError, Exception):
                pass
            return None
    return work.result()


async def _share_prompts(tm: TokenizerManager, msgs: list[TokenizedGenerateReq]) -> None:
    """Several samples of one prompt: prefill it once so the others hit the radix cache."""
    groups: dict[Any, list[TokenizedGenerateReq]] = {}
    for m in msgs:  # the salt is part of the key: a prompt is cached per salt
        groups.setdefault((m.cache_salt, tuple(m.input_ids)), []).append(m)
    await asyncio.gather(*(tm.cache_prompt(g[0]) for g in groups.values() if len(g) > 1))


async def _stream_generate(tm: TokenizerManager, msgs: list[TokenizedGenerateReq],
                           with_text: bool) -> AsyncIterator[bytes]:
    """SSE: `data: {...}` per chunk (with "index" when several requests), then `data: [DONE]`."""
    tasks: list[asyncio.Future] = []
    try:
        await _share_prompts(tm, msgs)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, msg: TokenizedGenerateReq) -> None:
            try:
                async for chunk in tm.generate(msg, with_text):
                    await queue.put((index, chunk))
            except ValueError as e:
                await queue.put((index, {"error": {"message": str(e)}}))
            finally:
                await queue.put((index, None))

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


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")
