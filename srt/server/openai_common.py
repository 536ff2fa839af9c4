"""Helpers shared by the OpenAI-compatible routes: body parsing, tokenizing and sampling
through the intake with errors named as the request names its fields, and JSON responses."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..io_struct import TokenizedGenerateReq
from .errors import RETRY_AFTER_S, Overloaded, ServerUnavailable
from .openai_protocol import OpenAIError
from .openai_runner import InternalAbort
from .tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


# ---- request helpers ---------------------------------------------------------------------------

async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise OpenAIError.from_validation_error(e) from None


def tokenize(tm: TokenizerManager, prompt: str | list[int], renames: dict[str, str]) -> list[int]:
    try:
        return tm.intake.prompt_ids(*((prompt, None) if isinstance(prompt, str) else (None, prompt)))
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def check_fits(tm: TokenizerManager, prompt_len: int, max_new: int, field: str) -> None:
    if prompt_len + max_new > tm.context_len:
        raise OpenAIError(f"{field}: the prompt has {prompt_len} tokens, and {prompt_len} + {max_new} exceeds the "
                          f"context length {tm.context_len}", field)


def samples(tm: TokenizerManager, ids: list[int], params: dict[str, Any], renames: dict[str, str],
             **options: Any) -> list[TokenizedGenerateReq]:
    """The intake's messages for one prompt, its errors named as this request names the field."""
    try:
        return tm.intake.samples(ids, params, **options)
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def as_openai_error(e: Exception, renames: dict[str, str]) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return OpenAIError.from_value_error(e, renames)
    if isinstance(e, Overloaded):
        return OpenAIError(str(e), status=429, err_type="rate_limit_error")
    if isinstance(e, ServerUnavailable):
        return OpenAIError(f"the server cannot finish the request: {e}", status=503, err_type="server_error")
    if isinstance(e, InternalAbort):
        return OpenAIError(f"the request failed in the server: {e}", status=500, err_type="server_error")
    logger.exception("request failed", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, err_type="server_error")


# ---- response helpers --------------------------------------------------------------------------

def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def error_response(e: OpenAIError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
    return json_response(e.body(), e.status, headers)
