"""OpenAI-compatible routes: /v1/models here; /v1/completions (completions.py),
/v1/chat/completions (chat_completions.py) and /v1/responses (responses/routes.py) on the
shared context of openai_common.py.

Every request runs through the request runner (request_runner.py): one intake message per
prompt and sample, admitted whole or refused with 429. Every error is an HTTP 400 (500 for our
own faults) in OpenAI's error shape, naming the request's field.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import Response

from .chat import ChatOptions
from .chat_completions import ChatCompletions
from .completions import Completions
from .openai_common import OpenAIContext, error_response, json_response
from .openai_protocol import OpenAIError
from .responses.routes import ResponsesRoutes
from .tokenizer_manager import TokenizerManager


def register_openai_routes(app: FastAPI, tm_getter: Callable[[], TokenizerManager], served_model_name: str,
                           chat_options: ChatOptions = ChatOptions()) -> None:
    api = OpenAIContext(tm_getter, served_model_name)
    models = _Models(api)
    chat = ChatCompletions(api, chat_options)
    app.add_api_route("/v1/models", models.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", models.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", Completions(api).completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.create, methods=["POST"])
    ResponsesRoutes(api, chat_options).register(app)


class _Models:
    def __init__(self, api: OpenAIContext):
        self.api = api
        self._created = int(time.time())

    def _card(self, adapter: str | None = None) -> dict[str, Any]:
        """The base model's card, or a LoRA adapter's (its parent the base model, as vLLM lists them)."""
        name = self.api.model_name
        card = {"id": adapter or name, "object": "model", "created": self._created, "owned_by": "radixlm",
                "root": name, "max_model_len": self.api.tm_getter().context_len}
        if adapter is not None:
            card["parent"] = name
        return card

    def _adapters(self) -> list[str]:
        adapters = self.api.tm_getter().adapters
        return sorted(adapters.usable()) if adapters is not None else []

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self._card()] + [self._card(a) for a in self._adapters()]})

    async def get_model(self, model_id: str) -> Response:
        name = self.api.model_name
        if model_id in self._adapters():
            return json_response(self._card(model_id))
        if model_id != name:
            return error_response(OpenAIError(f"model: {model_id!r} does not exist (this server serves {name!r})",
                                              "model", status=404, code="model_not_found"))
        return json_response(self._card())
