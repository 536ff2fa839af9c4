"""The router's HTTP routes.

Generation routes (/generate, /v1/completions, /v1/chat/completions, /v1/responses) go to the
worker the policy picks by the request's key; /v1/responses with a `previous_response_id`, and
GET/DELETE of a stored response, go to the worker that made that response (it alone stores it).
Model and tokenizer routes go to any healthy worker; /flush_cache, /abort_request and
/end_session to all of them. /health is 200 while any worker is healthy; /metrics and
/get_server_info gather every worker's.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from typing import Any, Callable

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..server.errors import error_response
from ..server.guard import OPEN_PATHS, bearer_token, run_with_body_cap
from . import request_keys
from .proxy import Proxy, forward_headers
from .workers import Worker, WorkerPool, describe_error, error_message

_ANY_WORKER_GET = ("/v1/models", "/v1/models/{model_id:path}", "/get_model_info", "/health_generate")
_ANY_WORKER_POST = ("/tokenize", "/v1/tokenize")
_GATHER_TIMEOUT_S = 5.0


class RouterGuard:
    """API key (as the server checks it: Authorization: Bearer <key>, /health open) and a cap on
    the body size, as a plain ASGI middleware."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(413, f"request body over {self.max_bytes} bytes (--max-request-bytes)")
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        if self.api_key and scope["path"] not in OPEN_PATHS:
            token = bearer_token(headers.get(b"authorization", b""))
            if token is None or not secrets.compare_digest(token, self.api_key):
                return await error_response(401, "missing or wrong API key (Authorization: Bearer "
                                            "<key>)")(scope, receive, send)
        await run_with_body_cap(self.app, scope, receive, send, self.max_bytes, too_large)


class ResponseOwners:
    """Which worker made each /v1/responses response (it alone stores it), bounded."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._owner: collections.OrderedDict[str, str] = collections.OrderedDict()

    def get(self, response_id: Any) -> str | None:
        return self._owner.get(response_id) if isinstance(response_id, str) else None

    def remember(self, worker: Worker, payload: bytes) -> None:
        """`payload`: a response object, or the first events of a stream (response.created)."""
        found = None
        try:
            found = orjson.loads(payload).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            for line in payload.split(b"\n"):
                if line.startswith(b"data:") and b"response.created" in line:
                    try:
                        found = orjson.loads(line[5:])["response"]["id"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        pass
        if isinstance(found, str):
            self._owner[found] = worker.url
            self._owner.move_to_end(found)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)


async def _unless_disconnected(request: Request, work: Any) -> Response:
    """Runs the forwarding; if the client leaves first, cancels it (closing the connection to
    the worker, which then aborts the request) and answers 499."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                return Response(status_code=499)
            if hasattr(result, "body_iterator"):  # the stream was ready just now: close it unused
                await result.body_iterator.aclose()
            return Response(status_code=499)


def create_router_app(pool: WorkerPool, proxy: Proxy, policy_name: str, api_key: str | None,
                      max_request_bytes: int, owners: ResponseOwners | None = None) -> FastAPI:
    app = FastAPI(title="radixlm router", docs_url=None, redoc_url=None)
    app.add_middleware(RouterGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    owners = owners or ResponseOwners()
    metrics = proxy.metrics

    async def generation(request: Request, path: str, key_of: Callable[[Any], str | None],
                         stream_style: str = "sse", responses: bool = False) -> Response:
        body = await request.body()
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None  # the worker answers the 400
        pinned = owners.get(parsed.get("previous_response_id")) if responses and isinstance(parsed, dict) else None
        return await _unless_disconnected(request, proxy.forward(
            request.method, path, body, forward_headers(request.headers), request.query_params, key=key_of(parsed),
            pinned=pinned, stream_style=stream_style, remember=owners.remember if responses else None))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        return await generation(request, "/generate", request_keys.generate_key)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "/v1/completions", request_keys.completion_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "/v1/chat/completions", request_keys.chat_key)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generation(request, "/v1/responses", request_keys.responses_key, "responses", responses=True)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        """The owner if known; otherwise each healthy worker until one knows the id."""
        headers = forward_headers(request.headers)
        path = f"/v1/responses/{response_id}"
        owner = owners.get(response_id)
        workers = sorted(pool.healthy(), key=lambda w: w.url != owner)
        answer: Response = error_response(404, f"response {response_id!r} not found")
        for worker in workers:
            answer = await proxy.forward(request.method, path, b"", headers, request.query_params,
                                         pinned=worker.url)
            if answer.status_code != 404:
                break
        return answer

    async def any_worker(request: Request) -> Response:
        body = await request.body()
        return await proxy.forward(request.method, request.url.path, body, forward_headers(request.headers),
                                   request.query_params)

    for path in _ANY_WORKER_GET:
        app.add_api_route(path, any_worker, methods=["GET"])
    for path in _ANY_WORKER_POST:
        app.add_api_route(path, any_worker, methods=["POST"])

    async def each_worker(method: str, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """The answer of every healthy worker: url -> httpx.Response or an error string."""
        async def one(w: Worker) -> Any:
            try:
                return await pool.client.request(method, w.url + path, content=body, headers=headers,
                                                 timeout=_GATHER_TIMEOUT_S)
            except httpx.HTTPError as e:
                return describe_error(e, _GATHER_TIMEOUT_S)
        workers = pool.healthy()
        return dict(zip([w.url for w in workers], await asyncio.gather(*(one(w) for w in workers))))

    async def to_all(request: Request) -> tuple[dict[str, Any], Response | None]:
        """The request sent to every healthy worker: their answers, and the response to give
        instead when not all of them said 200."""
        answers = await each_worker(request.method, request.url.path, await request.body(),
                                    forward_headers(request.headers))
        if not answers:
            return answers, proxy.unavailable([], set())
        failed = {u: a for u, a in answers.items() if isinstance(a, str) or a.status_code != 200}
        if not failed:
            return answers, None
        return answers, failure(request, answers, failed)

    async def broadcast(request: Request) -> Response:
        """/flush_cache and /abort_request: every healthy worker; 200 when all of them said 200."""
        answers, problem = await to_all(request)
        return problem or Response(next(iter(answers.values())).content, status_code=200)

    def failure(request: Request, answers: dict[str, Any], failed: dict[str, Any]) -> Response:
        client_fault = [a for a in failed.values() if not isinstance(a, str) and 400 <= a.status_code < 500]
        if len(client_fault) == len(failed):  # the same bad request everywhere: pass one 4xx on
            a = client_fault[0]
            return Response(a.content, status_code=a.status_code, media_type=a.headers.get("content-type"))
        detail = "; ".join(f"{u}: {a if isinstance(a, str) else f'HTTP {a.status_code} ' + error_message(a.content)}"
                           for u, a in failed.items())
        return error_response(502, f"{request.url.path} failed on {len(failed)} of {len(answers)} workers: {detail}")

    app.add_api_route("/flush_cache", broadcast, methods=["GET", "POST"])
    app.add_api_route("/abort_request", broadcast, methods=["POST"])

    @app.post("/end_session")
    async def end_session(request: Request) -> Response:
        """Every healthy worker ends the session (the policy may have sent its calls to more than
        one); "ended" is true when any of them knew it."""
        answers, problem = await to_all(request)
        if problem:
            return problem
        replies = [orjson.loads(a.content) for a in answers.values()]
        return Response(orjson.dumps({"session_id": replies[0].get("session_id"),
                                      "ended": any(r.get("ended") for r in replies)}), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        metrics.healthy.set(len(pool.healthy()))
        if pool.healthy():
            return Response(status_code=200)
        return proxy.unavailable([], set(), count=False)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        from .worker_metrics import merge_worker_metrics

        metrics.healthy.set(len(pool.healthy()))
        answers = await each_worker("GET", "/metrics", b"", pool.auth_headers)
        texts = {u: a.text for u, a in answers.items() if not isinstance(a, str) and a.status_code == 200}
        return Response(merge_worker_metrics(texts) + metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        answers = await each_worker("GET", "/get_server_info", b"", pool.auth_headers)
        workers = []
        for w in pool.workers:
            entry: dict[str, Any] = {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight,
                                     "requests": w.requests}
            if not w.healthy:
                entry["reason"] = w.reason
            a = answers.get(w.url)
            if isinstance(a, str):
                entry["error"] = a
            elif a is not None:
                entry["info"] = a.json() if a.status_code == 200 else None
                if a.status_code != 200:
                    entry["error"] = f"HTTP {a.status_code} {error_message(a.content)}"
            workers.append(entry)
        tree = getattr(proxy.policy, "tree", None)
        return JSONResponse({"router": {"policy": policy_name, "workers_healthy": len(pool.healthy()),
                                        "tree_chars": {w.url: tree.size(w.url) for w in pool.workers} if tree else {}},
                             "workers": workers})

    return app
