"""The HTTP front: SGLang's native API (/generate and friends), health, metrics, API keys.
/generate lives in generate_route.py, the request checks in guard.py, the OpenAI routes in
openai_api.py; every generation route runs its requests through request_runner.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import generate_route
from .errors import error_response
from .generate_route import json_object_body
from .guard import Guard
from .lora_routes import add_lora_routes
from .session_routes import add_session_routes
from .openapi_docs import document_bodies
from .tokenize_routes import add_tokenize_routes
from .tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ServerState:
    """What the handlers share: the tokenizer manager and whether the server serves.

    It serves once warm (launch.py runs a request through every process first) until a child
    dies (unhealthy) or shutdown begins (draining); /health is 200 exactly while it serves."""

    def __init__(self, tm: TokenizerManager, model_path: str, server_args: dict[str, Any], warm: bool = True):
        self.tm = tm
        self.model_path = model_path
        self.server_args = server_args
        self.healthy = True
        self.unhealthy_reason = ""
        self.warm = warm
        self.draining = False

    @property
    def serving(self) -> bool:
        return self.healthy and self.warm and not self.draining

    @property
    def not_serving_reason(self) -> str:
        if not self.healthy:
            return f"unhealthy: {self.unhealthy_reason}"
        if self.draining:
            return "shutting down"
        return "" if self.warm else "warming up"


def create_app(state: ServerState, api_key: str | None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               rate_limit_rpm: int = 0, incremental_streaming_output: bool = False) -> FastAPI:
    app = FastAPI(title="radixlm", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(Guard, state=state, api_key=api_key, max_request_bytes=max_request_bytes,
                       rate_limit_rpm=rate_limit_rpm)

    @app.get("/health")
    async def health() -> Response:
        if not state.serving:
            return error_response(503, state.not_serving_reason)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not state.serving:
            return error_response(503, state.not_serving_reason)
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
                "chat_template": getattr(tok, "chat_template", None), "special_tokens": special,
                # Whether a client's programs may keep sessions (docs/sessions.md).
                "program_sessions": bool(state.server_args.get("session_ttl")),
                # A vision-language model's image token, once per image in a prompt's text (None: no images).
                "image_token": images.placeholder if (images := state.tm.intake.images) is not None else None}

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        reply = await state.tm.control("server_info")
        public_args = {k: v for k, v in state.server_args.items() if k != "api_key"}
        return {**public_args, **reply.data, "num_active_requests_main": state.tm.num_active}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        # ?storage=true also empties the hierarchical cache's disk tier (shared with replicas).
        storage = request.query_params.get("storage", "false").lower() in ("1", "true", "yes")
        reply = await state.tm.control("flush_cache_storage" if storage else "flush_cache")
        if not reply.ok:
            return error_response(400, f"cache not flushed: {reply.data.get('message', '')}")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_object_body(request)
        if isinstance(body, Response):
            return body
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            return error_response(400, "abort_all: must be a boolean", "abort_all")
        if abort_all:
            # Ending every client's requests is an operator's act: only behind an API key.
            if not api_key:
                return error_response(403, "abort_all: needs a server started with --api-key", "abort_all")
            await state.tm.abort("", abort_all=True)
            return Response(status_code=200)
        if not isinstance(rid, str) or not rid:
            return error_response(400, "rid: must be a non-empty string (abort_all: true aborts every request)",
                                  "rid")
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

    add_lora_routes(app, lambda: state.tm)
    add_session_routes(app, lambda: state.tm)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        return await generate_route.generate(state.tm, request, incremental_streaming_output)

    add_tokenize_routes(app, state)
    document_bodies(app)
    return app
