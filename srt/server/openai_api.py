"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request becomes one GenerateRequest per prompt and sample (choice index = prompt_index * n
+ sample_index). Samples of one prompt share its KV: the prompt is prefilled once
(`cache_prompt`), then the samples run concurrently and hit the radix cache. Every error is an
HTTP 400 (500 for our own faults) in OpenAI's error shape, naming the request's field.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixlm.srt.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, TokenText,
                                         chat_logprobs, choice, completion_logprobs, finish_reason_of,
                                         logprob_entries)
from radixlm.srt.server.tokenizer_manager import GenerateRequest, TokenizerManager, expand_n

logger = logging.getLogger(__name__)

_DONE = object()  # a sample's end marker in _SampleRunner's queue


def register_openai_routes(app: FastAPI, tm_getter: Callable[[], TokenizerManager], served_model_name: str) -> None:
    api = _OpenAIServing(tm_getter, served_model_name)
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])


@dataclass
class _Job:
    """A request turned into samples: groups[p] holds prompt p's n samples, in choice order."""

    groups: list[list[GenerateRequest]]
    prompt_lens: list[int]
    echo_texts: list[str]
    renames: dict[str, str]  # TokenizerManager field name -> this request's field name

    @property
    def num_choices(self) -> int:
        return sum(len(g) for g in self.groups)

    def usage(self, finals: list[dict[str, Any]]) -> dict[str, Any]:
        metas = [f["meta_info"] for f in finals]
        completion = sum(m["completion_tokens"] for m in metas)
        cached, i = 0, 0
        for group in self.groups:  # later samples of a prompt hit the cache its first prefill filled
            cached += min(m["cached_tokens"] for m in metas[i:i + len(group)])
            i += len(group)
        prompt = sum(self.prompt_lens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class _SampleRunner:
    """Runs every sample of a job concurrently and hands out (choice index, result) as they come.

    `close()` cancels whatever still runs; cancelling a sample's task closes its
    TokenizerManager generator, which aborts the request in the scheduler.
    """

    def __init__(self, tm: TokenizerManager, job: _Job):
        self._tm = tm
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._remaining = job.num_choices
        first = 0
        for group in job.groups:
            self._spawn(self._run_group(first, group))
            first += len(group)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, first: int, group: list[GenerateRequest]) -> None:
        if len(group) > 1:
            try:
                await self._tm.cache_prompt(group[0])
            except Exception as e:
                self._queue.put_nowait((first, e))
                return
        for i, req in enumerate(group):
            self._spawn(self._run_one(first + i, req))

    async def _run_one(self, index: int, req: GenerateRequest) -> None:
        results = self._tm.generate(req)
        try:
            async for out in results:
                reason = out["meta_info"].get("finish_reason") or {}
                if reason.get("type") == "abort" and reason.get("message"):
                    raise _InternalAbort(reason["message"])  # the scheduler failed it, not the client
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, _DONE))
        except Exception as e:
            self._queue.put_nowait((index, e))
        finally:
            await results.aclose()

    async def next_output(self) -> tuple[int, dict[str, Any]] | None:
        """The next result, or None once every sample finished; raises a sample's exception."""
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def client_left(self) -> None:
        """Stops everything and makes the consumer's next_output raise _ClientLeft."""
        self.close()
        self._queue.put_nowait((-1, _ClientLeft()))


class _ClientLeft(Exception):
    pass


class _InternalAbort(Exception):
    """The scheduler ended a request on an internal error (an abort with a message)."""


class _EventStream(StreamingResponse):
    """SSE response that always closes its body generator, also when the client went away
    (ASGI servers on spec 2.4 report that by a failing send, leaving the generator open)."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


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
            return _EventStream(self._stream_completion(job, body, envelope))
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

    def _completion_job(self, body: CompletionRequest) -> _Job:
        tm = self._tm_getter()
        renames = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "text": "prompt",
                   "input_ids": "prompt", "top_logprobs_num": "logprobs"}
        groups, lens, echo_texts = [], [], []
        for prompt in body.prompts():
            ids = _tokenize(tm, prompt, renames)
            max_new = 16 if body.max_tokens is None else body.max_tokens
            _check_fits(tm, len(ids), max_new, "max_tokens")
            base = GenerateRequest(input_ids=ids, sampling_params=body.sampling_params(max_new),
                                   return_logprob=body.logprobs is not None,
                                   logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
                                   top_logprobs_num=body.logprobs or 0, stream=body.stream)
            groups.append(_expand_and_validate(tm, base, renames))
            lens.append(len(ids))
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else tm.tokenizer.decode(ids))
        return _Job(groups, lens, echo_texts, renames)

    async def _stream_completion(self, job: _Job, body: CompletionRequest,
                                 envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        n = job.num_choices
        sent_chars, sent_prompt, sent_output, offsets = [0] * n, [0] * n, [0] * n, [0] * n
        echoed = [not body.echo] * n
        finals: list[Any] = [None] * n
        runner = _SampleRunner(self._tm_getter(), job)
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
                    yield _sse({**envelope, "choices": [choice(meta, index=index, text=text, logprobs=logprobs)]})
            if body.include_usage:
                yield _sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield b"data: [DONE]\n\n"
        except Exception as e:
            yield _sse(_as_openai_error(e, job.renames).body())
            yield b"data: [DONE]\n\n"
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
            return _EventStream(self._stream_chat(job, body, envelope))
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

    def _chat_job(self, body: ChatCompletionRequest) -> _Job:
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
        base = GenerateRequest(input_ids=ids, sampling_params=params, return_logprob=body.logprobs,
                               top_logprobs_num=body.top_logprobs or 0, stream=body.stream)
        return _Job([_expand_and_validate(tm, base, renames)], [len(ids)], [], renames)

    async def _stream_chat(self, job: _Job, body: ChatCompletionRequest,
                           envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        n = job.num_choices
        sent_chars, sent_tokens = [0] * n, [0] * n
        finals: list[Any] = [None] * n
        runner = _SampleRunner(self._tm_getter(), job)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None) -> bytes:
            return _sse({**envelope, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
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
                    yield _sse({**envelope, "choices": [choice(meta, index=index, delta={}, logprobs=None)]})
            if body.include_usage:
                yield _sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield b"data: [DONE]\n\n"
        except Exception as e:
            yield _sse(_as_openai_error(e, job.renames).body())
            yield b"data: [DONE]\n\n"
        finally:
            runner.close()

    # ---- shared ----------------------------------------------------------------------------------

    def _names(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self._tm_getter().tokenizer)
        return self._token_text

    async def _run_to_end(self, job: _Job, request: Request) -> list[dict[str, Any]] | Response:
        """Every sample's final result in choice order, or the error response; aborts all
        samples if the client disconnects first."""
        finals: list[Any] = [None] * job.num_choices
        runner = _SampleRunner(self._tm_getter(), job)
        watcher = asyncio.get_running_loop().create_task(_call_on_disconnect(request, runner.client_left))
        try:
            while (item := await runner.next_output()) is not None:
                finals[item[0]] = item[1]
            return finals
        except _ClientLeft:
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


async def _call_on_disconnect(request: Request, callback: Callable[[], None]) -> None:
    """Waits for the client to go away (reads the ASGI receive channel until it says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    callback()


def _tokenize(tm: TokenizerManager, prompt: str | list[int], renames: dict[str, str]) -> list[int]:
    req = GenerateRequest(text=prompt) if isinstance(prompt, str) else GenerateRequest(input_ids=prompt)
    try:
        return tm.tokenize(req)
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def _check_fits(tm: TokenizerManager, prompt_len: int, max_new: int, field: str) -> None:
    if prompt_len + max_new > tm.context_len:
        raise OpenAIError(f"{field}: the prompt has {prompt_len} tokens, and {prompt_len} + {max_new} exceeds the "
                          f"context length {tm.context_len}", field)


def _expand_and_validate(tm: TokenizerManager, base: GenerateRequest, renames: dict[str, str]) -> list[GenerateRequest]:
    try:
        samples = expand_n(base)
        for sample in samples:
            tm.validate(sample)
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None
    return samples


def _as_openai_error(e: Exception, renames: dict[str, str]) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return OpenAIError.from_value_error(e, renames)
    if isinstance(e, _InternalAbort):
        return OpenAIError(f"the request failed in the server: {e}", status=500, err_type="server_error")
    logger.exception("request failed", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, err_type="server_error")


# ---- response helpers --------------------------------------------------------------------------

def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(e: OpenAIError) -> Response:
    return _json(e.body(), e.status)


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
