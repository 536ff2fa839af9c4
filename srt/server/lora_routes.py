"""LoRA adapters seen from the main process: which names requests may use, the OpenAI `model`
names that select one, and the routes that load and unload adapters while serving.

An unload first stops accepting the name (a new request naming it gets 400), then waits for the
requests already running on it to finish, then has the scheduler drop it: no request loses its
adapter half way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..lora.adapter import parse_lora_paths
from .errors import error_response
from .generate_route import json_object_body

UNLOAD_WAIT_S = 600.0  # how long an unload waits for the requests running on the adapter
_POLL_S = 0.02


class AdapterNames:
    """The adapters requests may name, kept in step with the scheduler's by the routes below."""

    def __init__(self, base_model_name: str, lora_paths: tuple[str, ...] | None):
        self.base_model_name = base_model_name
        self.paths: dict[str, str] = dict(parse_lora_paths(lora_paths))
        self._unloading: set[str] = set()
        self._lock = asyncio.Lock()  # one load or unload at a time

    def usable(self) -> list[str]:
        return [name for name in self.paths if name not in self._unloading]

    def for_model(self, model: str | None) -> str | None:
        """The adapter an OpenAI `model` selects: the base model's name (or none) is the base
        model; `<adapter>` or `<base>:<adapter>` an adapter. ValueError for anything else."""
        if model is None or model == self.base_model_name:
            return None
        base, sep, adapter = model.rpartition(":")
        name = adapter if sep and base == self.base_model_name else model
        if name in self.usable():
            return name
        raise ValueError(f"model: {model!r} does not exist (this server serves {self.base_model_name!r} and the "
                         f"adapters {', '.join(sorted(self.usable())) or 'none'})")

    async def load(self, tm, name: Any, path: Any) -> tuple[int, dict[str, Any]]:
        async with self._lock:
            reply = await tm.control("load_lora_adapter", args={"lora_name": name, "lora_path": path}, timeout=300)
            if not reply.ok:
                return reply.data.get("status", 400), {"error": reply.data.get("message", "not loaded")}
            self.paths[name] = path
            return 200, {"success": True, **reply.data}

    async def unload(self, tm, name: Any) -> tuple[int, dict[str, Any]]:
        async with self._lock:
            if name not in self.paths:
                return 400, {"error": f"lora_name: adapter {name!r} is not loaded"}
            self._unloading.add(name)
            try:
                deadline = time.monotonic() + UNLOAD_WAIT_S
                while tm.running_on_adapter(name):
                    if time.monotonic() > deadline:
                        return 409, {"error": f"lora_name: requests on {name!r} still run after {UNLOAD_WAIT_S:.0f}s"}
                    await asyncio.sleep(_POLL_S)
                reply = await tm.control("unload_lora_adapter", args={"lora_name": name})
                if not reply.ok:
                    return 400, {"error": reply.data.get("message", "not unloaded")}
                del self.paths[name]
                return 200, {"success": True, **reply.data}
            finally:
                self._unloading.discard(name)


def add_lora_routes(app: FastAPI, tm_getter) -> None:
    """SGLang's /load_lora_adapter ({"lora_name", "lora_path"}) and /unload_lora_adapter
    ({"lora_name"})."""

    async def change(request: Request, act) -> Response:
        """Runs `act(tm, body)` -> (status, reply) on a JSON object body."""
        tm = tm_getter()
        if tm.adapters is None:
            return error_response(400, "lora_name: the server runs without --enable-lora", "lora_name")
        body = await json_object_body(request)
        if isinstance(body, Response):
            return body
        status, data = await act(tm, body)
        return JSONResponse(data) if status == 200 else error_response(status, data["error"], "lora_name")

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await change(request, lambda tm, body: tm.adapters.load(tm, body.get("lora_name"),
                                                                        body.get("lora_path")))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await change(request, lambda tm, body: tm.adapters.unload(tm, body.get("lora_name")))
