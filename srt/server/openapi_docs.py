"""The OpenAPI document (/openapi.json) with a request-body schema for every route that takes a
body and one operationId per (method, path), so that schemathesis and client generators can use
it. Handlers read their bodies themselves (to name a bad field in our own error shape and to
stream), so FastAPI cannot infer the bodies; the models here declare them."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Doc):
    """SGLang's /generate: one prompt (text or input_ids) or a list of them."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="max_new_tokens, temperature, top_p, top_k, stop, regex, json_schema, n, seed, ...")
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=64)
    return_text_in_logprobs: bool = False
    cache_salt: str | None = None
    lora_path: str | None | list[str | None] = Field(
        None, description="a LoRA adapter's name (--enable-lora), or one per prompt; null: the base model")
    session_id: str | None = Field(None, min_length=1, max_length=128,
                                   description="the program session whose latest prefix stays cached")
    image_data: str | list[str | None | list[str]] | None = Field(
        None, description="vision-language models: an image (a data URL or base64; an http(s) URL with "
                          "--allow-remote-images) or a list of them, or one such entry per prompt of a batch; each "
                          "image's placeholder token sits in its prompt where it goes")


class LoadLoRARequest(_Doc):
    lora_name: str = Field(description="the name requests will use")
    lora_path: str = Field(description="a PEFT adapter directory on the server's disk")


class UnloadLoRARequest(_Doc):
    lora_name: str


class EndSessionRequest(_Doc):
    session_id: str = Field(min_length=1, max_length=128)


class AbortRequest(_Doc):
    rid: str | None = Field(None, description="the request to abort")
    abort_all: bool = Field(False, description="abort every request (only on a server with --api-key)")


class TokenizeRequest(_Doc):
    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None


def _bodies() -> dict[str, type[BaseModel]]:
    from .openai_protocol import ChatCompletionRequest, CompletionRequest
    from .responses.protocol import ResponsesRequest

    return {"/generate": GenerateRequest, "/abort_request": AbortRequest, "/tokenize": TokenizeRequest,
            "/v1/tokenize": TokenizeRequest, "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest, "/v1/responses": ResponsesRequest,
            "/load_lora_adapter": LoadLoRARequest, "/unload_lora_adapter": UnloadLoRARequest,
            "/end_session": EndSessionRequest}


def document_bodies(app: FastAPI) -> None:
    """Replaces app.openapi with a builder that adds the bodies (of routes registered by then or
    later: the document is built on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    bodies = _bodies()
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            op["operationId"] = f"{method}_{re.sub(r'[^a-zA-Z0-9]+', '_', path).strip('_')}"
            model = bodies.get(path)
            if model is None or method not in ("post", "put"):
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc
