"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request becomes one intake message per prompt and sample (choice index = prompt_index * n
+ sample_index), run by openai_runner.SampleRunner. Every error is an HTTP 400 (500 for our own
faults) in OpenAI's error shape, naming the request's field.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from radixlm.srt.io_struct import TokenizedGenerateReq
from radixlm.srt.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, TokenText,
                                                chat_logprobs, choice, completion_logprobs, finish_reason_of,
                                                logprob_entries)
from radixlm.srt.server.openai_runner import ClientLeft, InternalAbort, Job, SampleRunner, call_on_disconnect
from radixlm.srt.server.streaming import SSE_DONE, EventStream, sse
from radixlm.srt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def register_openai_routes(app: FastAPI, tm_getter: Callable[[], TokenizerManager], served_model_name: str) -> None:
    api = _OpenAIServing(tm_getter, served_model_name)
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])


class _OpenAIServing:
    def __init__(self, tm_getter: Callable[[], TokenizerManager], served_model_name: str):
        self._tm_getter = tm_getter
        self._model = served_model_name
        self._created = int(time.time())
        self._token_text: TokenText | None = None

    # ---- models --------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self._model, "object": "model", "created": self._created, "owned_by": "radixlm",
                "root": self._model, "max_model_len": self._tm_getter().context_len}

    async def list_models(self) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def get_model(self, model_id: str) -> Response:
        if model_id != self._model:
            return _error(OpenAIError(f"model: {model_id!r} does not exist (this server serves {self._model!r})",
                                      "model", status=404, code="model_not_found"))
        return _json(self._model_card())

    def _envelope(self, id_prefix: str, kind: str) -> dict[str, Any]:
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self._model, "system_fingerprint": None}

    # ---- completions ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body = await _parse(request, CompletionRequest)
            body.check_unsupported()
            job = self._completion_job(body)
        except OpenAIError as e:
            return _error(e)
        envelope = self._envelope("cmpl", "text_completion")
        if body.stream:
            return EventStream(self._stream_completion(job, body, envelope))
        finals = await self._run_to_end(job, request)
        if isinstance(finals, Response):
            return finals
        choices = []
        for index, out in enumerate(finals):
            meta = out["meta_info"]
            text, logprobs = out["text"], None
            if body.echo:
                text = job.echo_texts[index // body.n] + text
            if body.logprobs is not None:
                entries = (logprob_entries(meta, "input") if body.echo else []) + logprob_entries(meta, "output")
                logprobs, _ = completion_logprobs(self._names(), entries, 0)
            choices.append(choice(meta, index=index, text=text, logprobs=logprobs))
        return _json({**envelope, "choices": choices, "usage": job.usage(finals)})

    def _completion_job(self, body: CompletionRequest) -> Job:
        tm = self._tm_getter()
        renames = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "text": "prompt",
                   "input_ids": "prompt", "top_logprobs_num": "logprobs"}
        groups, echo_texts = [], []
        for prompt in body.prompts():
            ids = _tokenize(tm, prompt, renames)
            max_new = 16 if body.max_tokens is None else body.max_tokens
            _check_fits(tm, len(ids), max_new, "max_tokens")
            groups.append(_samples(tm, ids, body.sampling_params(max_new), renames,
                                   return_logprob=body.logprobs is not None,
                                   logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
                                   top_logprobs_num=body.logprobs or 0, stream=body.stream,
                                   cache_salt=body.cache_salt))
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else tm.tokenizer.decode(ids))
        return Job(groups, echo_texts, renames)

    async def _stream_completion(self, job: Job, body: CompletionRequest,
                                 envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        n = job.num_choices
        sent_chars, sent_prompt, sent_output, offsets = [0] * n, [0] * n, [0] * n, [0] * n
        echoed = [not body.echo] * n
        finals: list[Any] = [None] * n
        runner = SampleRunner(self._tm_getter(), job)
        try:
            while (item := await runner.next_output()) is not None:
                index, out = item
                meta = out["meta_info"]
                text = out["text"][sent_chars[index]:]
                sent_chars[index] = len(out["text"])
                if not echoed[index]:
                    text, echoed[index] = job.echo_texts[index // body.n] + text, True
                prompt_entries = logprob_entries(meta, "input") if body.echo else []
                output_entries = logprob_entries(meta, "output")
                entries = prompt_entries[sent_prompt[index]:] + output_entries[sent_output[index]:]
                sent_prompt[index], sent_output[index] = len(prompt_entries), len(output_entries)
                logprobs = None
                if body.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(self._names(), entries, offsets[index])
                finish = finish_reason_of(meta)
                if finish is not None:
                    finals[index] = out
                if text or finish is not None or (logprobs and logprobs["tokens"]):
                    yield sse({**envelope, "choices": [choice(meta, index=index, text=text, logprobs=logprobs)]})
            if body.include_usage:
                yield sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield SSE_DONE
        except Exception as e:
            yield sse(_as_openai_error(e, job.renames).body())
            yield SSE_DONE
        finally:
            runner.close()

    # ---- chat completions ----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await _parse(request, ChatCompletionRequest)
            body.check_unsupported()
            job = self._chat_job(body)
        except OpenAIError as e:
            return _error(e)
        envelope = self._envelope("chatcmpl", "chat.completion")
        if body.stream:
            envelope["object"] = "chat.completion.chunk"
            return EventStream(self._stream_chat(job, body, envelope))
        finals = await self._run_to_end(job, request)
        if isinstance(finals, Response):
            return finals
        choices = []
        for index, out in enumerate(finals):
            meta = out["meta_info"]
            logprobs = None
            if body.logprobs:
                logprobs = {"content": chat_logprobs(self._names(), logprob_entries(meta, "output"))}
            choices.append(choice(meta, index=index, message={"role": "assistant", "content": out["text"]},
                                  logprobs=logprobs))
        return _json({**envelope, "choices": choices, "usage": job.usage(finals)})

    def _chat_job(self, body: ChatCompletionRequest) -> Job:
        tm = self._tm_getter()
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        renames = {"max_new_tokens": max_field, "min_new_tokens": "min_tokens", "text": "messages",
                   "input_ids": "messages", "top_logprobs_num": "top_logprobs"}
        messages = []
        for i, m in enumerate(body.messages):
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        if not getattr(tm.tokenizer, "chat_template", None):
            raise OpenAIError("messages: this model has no chat template; use /v1/completions", "messages")
        try:
            rendered = tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (role order, ...) fail with assorted types
            raise OpenAIError(f"messages: the chat template rejected them: {e}", "messages") from None
        ids = _tokenize(tm, rendered, renames)  # the template already holds BOS and special tokens
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_new is None:
            max_new = tm.context_len - len(ids)
        _check_fits(tm, len(ids), max_new, max_field)
        params = body.sampling_params(max_new)
        schema = body.schema_from_response_format()
        if schema is not None:
            params["json_schema"] = schema
            json_object = body.response_format.type == "json_object"
            renames["json_schema"] = "response_format" if json_object else "response_format.json_schema.schema"
        samples = _samples(tm, ids, params, renames, return_logprob=body.logprobs,
                           top_logprobs_num=body.top_logprobs or 0, stream=body.stream, cache_salt=body.cache_salt)
        return Job([samples], [], renames)

    async def _stream_chat(self, job: Job, body: ChatCompletionRequest,
                           envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        n = job.num_choices
        sent_chars, sent_tokens = [0] * n, [0] * n
        finals: list[Any] = [None] * n
        runner = SampleRunner(self._tm_getter(), job)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None) -> bytes:
            return sse({**envelope, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": None}]})

        try:
            for index in range(n):
                yield chunk(index, {"role": "assistant", "content": ""})
            while (item := await runner.next_output()) is not None:
                index, out = item
                meta = out["meta_info"]
                text = out["text"][sent_chars[index]:]
                sent_chars[index] = len(out["text"])
                entries = logprob_entries(meta, "output")[sent_tokens[index]:]
                sent_tokens[index] += len(entries)
                if text or entries:
                    logprobs = {"content": chat_logprobs(self._names(), entries)} if body.logprobs else None
                    yield chunk(index, {"content": text}, logprobs=logprobs)
                finish = finish_reason_of(meta)
                if finish is not None:
                    finals[index] = out
                    yield sse({**envelope, "choices": [choice(meta, index=index, delta={}, logprobs=None)]})
            if body.include_usage:
                yield sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield SSE_DONE
        except Exception as e:
            yield sse(_as_openai_error(e, job.renames).body())
            yield SSE_DONE
        finally:
            runner.close()

    # ---- shared ----------------------------------------------------------------------------------

    def _names(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self._tm_getter().tokenizer)
        return self._token_text

    async def _run_to_end(self, job: Job, request: Request) -> list[dict[str, Any]] | Response:
        """Every sample's final result in choice order, or the error response; aborts all
        samples if the client disconnects first."""
        finals: list[Any] = [None] * job.num_choices
        runner = SampleRunner(self._tm_getter(), job)
        watcher = asyncio.get_running_loop().create_task(call_on_disconnect(request, runner.client_left))
        try:
            while (item := await runner.next_output()) is not None:
                finals[item[0]] = item[1]
            return finals
        except ClientLeft:
            return Response(status_code=499)
        except Exception as e:
            return _error(_as_openai_error(e, job.renames))
        finally:
            watcher.cancel()
            runner.close()


# ---- request helpers ---------------------------------------------------------------------------

async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise OpenAIError.from_validation_error(e) from None


def _tokenize(tm: TokenizerManager, prompt: str | list[int], renames: dict[str, str]) -> list[int]:
    try:
        return tm.intake.prompt_ids(*((prompt, None) if isinstance(prompt, str) else (None, prompt)))
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def _check_fits(tm: TokenizerManager, prompt_len: int, max_new: int, field: str) -> None:
    if prompt_len + max_new > tm.context_len:
        raise OpenAIError(f"{field}: the prompt has {prompt_len} tokens, and {prompt_len} + {max_new} exceeds the "
                          f"context length {tm.context_len}", field)


def _samples(tm: TokenizerManager, ids: list[int], params: dict[str, Any], renames: dict[str, str],
             **options: Any) -> list[TokenizedGenerateReq]:
    """The intake's messages for one prompt, its errors named as this request names the field."""
    try:
        return tm.intake.samples(ids, params, **options)
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def _as_openai_error(e: Exception, renames: dict[str, str]) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return OpenAIError.from_value_error(e, renames)
    if isinstance(e, InternalAbort):
        return OpenAIError(f"the request failed in the server: {e}", status=500, err_type="server_error")
    logger.exception("request failed", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, err_type="server_error")


# ---- response helpers --------------------------------------------------------------------------

def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(e: OpenAIError) -> Response:
    return _json(e.body(), e.status)
