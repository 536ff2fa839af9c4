"""OpenAI-compatible routes: /v1/models, /v1/completions; /v1/chat/completions (chat_completions.py)
and /v1/responses (responses/routes.py) build on the shared parts here.

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

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .chat import ChatOptions
from .openai_common import (as_openai_error, check_fits, error_response, json_response, parse_body,
                            samples, tokenize)
from .openai_protocol import (CompletionRequest, OpenAIError, TokenText, choice, completion_logprobs,
                              finish_reason_of, logprob_entries)
from .openai_runner import Job, SampleRunner
from .run_to_end import run_to_end
from .streaming import SSE_DONE, EventStream, sse
from .tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def register_openai_routes(app: FastAPI, tm_getter: Callable[[], TokenizerManager], served_model_name: str,
                           chat_options: ChatOptions = ChatOptions()) -> None:
    from .chat_completions import ChatCompletions
    from .responses.routes import ResponsesRoutes

    api = OpenAIServing(tm_getter, served_model_name)
    chat = ChatCompletions(api, chat_options)
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.create, methods=["POST"])
    ResponsesRoutes(chat).register(app)


class OpenAIServing:
    def __init__(self, tm_getter: Callable[[], TokenizerManager], served_model_name: str):
        self.tm_getter = tm_getter
        self.model_name = served_model_name
        self._created = int(time.time())
        self._token_text: TokenText | None = None

    # ---- models --------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "radixlm",
                "root": self.model_name, "max_model_len": self.tm_getter().context_len}

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, model_id: str) -> Response:
        if model_id != self.model_name:
            return error_response(OpenAIError(f"model: {model_id!r} does not exist (this server serves {self.model_name!r})",
                                      "model", status=404, code="model_not_found"))
        return json_response(self._model_card())

    def envelope(self, id_prefix: str, kind: str) -> dict[str, Any]:
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None}

    # ---- completions ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body = await parse_body(request, CompletionRequest)
            body.check_unsupported()
            job = await asyncio.to_thread(self._completion_job, body)  # tokenizing off the event loop
        except OpenAIError as e:
            return error_response(e)
        envelope = self.envelope("cmpl", "text_completion")
        if body.stream:
            return EventStream(self._stream_completion(job, body, envelope))
        finals = await run_to_end(request, SampleRunner(self.tm_getter(), job).outputs(), job.renames,
                                  job.num_choices)
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
                logprobs, _ = completion_logprobs(self.names(), entries, 0)
            choices.append(choice(meta, index=index, text=text, logprobs=logprobs))
        return json_response({**envelope, "choices": choices, "usage": job.usage(finals)})

    def _completion_job(self, body: CompletionRequest) -> Job:
        tm = self.tm_getter()
        renames = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "text": "prompt",
                   "input_ids": "prompt", "top_logprobs_num": "logprobs"}
        groups, echo_texts = [], []
        for prompt in body.prompts():
            ids = tokenize(tm, prompt, renames)
            max_new = 16 if body.max_tokens is None else body.max_tokens
            check_fits(tm, len(ids), max_new, "max_tokens")
            groups.append(samples(tm, ids, body.sampling_params(max_new), renames,
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
        runner = SampleRunner(self.tm_getter(), job)
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
                    logprobs, offsets[index] = completion_logprobs(self.names(), entries, offsets[index])
                finish = finish_reason_of(meta)
                if finish is not None:
                    finals[index] = out
                if text or finish is not None or (logprobs and logprobs["tokens"]):
                    yield sse({**envelope, "choices": [choice(meta, index=index, text=text, logprobs=logprobs)]})
            if body.include_usage:
                yield sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield SSE_DONE
        except Exception as e:
            yield sse(as_openai_error(e, job.renames).body())
            yield SSE_DONE
        finally:
            runner.close()

    # ---- shared ----------------------------------------------------------------------------------

    def names(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tm_getter().tokenizer)
        return self._token_text
