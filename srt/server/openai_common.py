"""What the OpenAI-compatible routes share: the serving context (tokenizer manager, model
name, response envelope, token texts), body parsing, tokenizing and sampling through the intake
with errors named as the request names its fields, running a request to its end, and JSON
responses."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..io_struct import TokenizedGenerateReq
from .errors import RETRY_AFTER_S, InternalAbort, Overloaded, ServerUnavailable
from .openai_protocol import OpenAIError, TokenText
from .request_runner import RequestRunner, unless_disconnected
from .streaming import SSE_DONE, EventStream, sse
from .tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)
T = TypeVar("T")


class OpenAIContext:
    """What every OpenAI route needs: the tokenizer manager, the served model's name, the
    envelope of a response and token texts for logprobs."""

    def __init__(self, tm_getter: Callable[[], TokenizerManager], served_model_name: str):
        self.tm_getter = tm_getter
        self.model_name = served_model_name
        self._token_text: TokenText | None = None

    def envelope(self, id_prefix: str, kind: str, adapter: str | None = None) -> dict[str, Any]:
        """The response's fields beside its choices; `model` is the LoRA adapter's name when the
        request ran on one."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": adapter or self.model_name, "system_fingerprint": None}

    def names(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tm_getter().tokenizer)
        return self._token_text


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


def adapter_of(tm: TokenizerManager, model: str | None) -> str | None:
    """The LoRA adapter an OpenAI `model` names ("<adapter>" or "<base>:<adapter>"); without
    --enable-lora the model name is not checked (clients send many spellings of it)."""
    if tm.adapters is None:
        return None
    try:
        return tm.adapters.for_model(model)
    except ValueError as e:
        raise OpenAIError(str(e), "model", status=404, code="model_not_found") from None


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


# ---- running ------------------------------------------------------------------------------------

async def open_runner(tm: TokenizerManager, msgs: list[TokenizedGenerateReq], renames: dict[str, str],
                      failed_stream: Callable[[Exception], AsyncIterator[bytes]] | None = None
                      ) -> RequestRunner | Response:
    """The request's runner, or the response that answers instead: 429 when it is not admitted,
    else the error; for a stream (`failed_stream` given), an event stream of the error that
    `failed_stream` writes, as when a stream fails later."""
    try:
        return await RequestRunner.open(tm, msgs)
    except Overloaded as e:
        return error_response(as_openai_error(e, renames))
    except (ValueError, ServerUnavailable) as e:
        return EventStream(failed_stream(e)) if failed_stream else error_response(as_openai_error(e, renames))


async def error_events(e: Exception, renames: dict[str, str]) -> AsyncIterator[bytes]:
    yield sse(as_openai_error(e, renames).body())
    yield SSE_DONE


async def run_whole(request: Request, runner: RequestRunner, work: Awaitable[T],
                    renames: dict[str, str]) -> T | Response:
    """`work` (reading `runner`) run to its end, or the response that answers instead: the
    error it raised, or 499 when the client left first (its requests are aborted at once)."""
    try:
        result = await unless_disconnected(request, work)
    except Exception as e:
        return error_response(as_openai_error(e, renames))
    finally:
        await runner.close()
    return Response(status_code=499) if result is None else result


# ---- response helpers --------------------------------------------------------------------------

def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def error_response(e: OpenAIError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
    return json_response(e.body(), e.status, headers)
