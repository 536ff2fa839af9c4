"""/v1/completions: each prompt's n samples (choice index = prompt_index * n + sample_index) run
by the request runner, answered whole or streamed as OpenAI does, with echo and logprobs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..io_struct import TokenizedGenerateReq
from .openai_common import (OpenAIContext, adapter_of, as_openai_error, check_fits, error_events, error_response,
                            json_response, open_runner, parse_body, run_whole, samples, tokenize)
from .openai_protocol import (CompletionRequest, OpenAIError, choice, completion_logprobs, finish_reason_of,
                              logprob_entries, samples_usage)
from .request_runner import RequestRunner
from .streaming import SSE_DONE, EventStream, sse

_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "text": "prompt",
            "input_ids": "prompt", "top_logprobs_num": "logprobs"}


@dataclass(frozen=True)
class _Job:
    """A request's samples: groups[p] holds prompt p's n samples, in choice order."""

    body: CompletionRequest
    groups: list[list[TokenizedGenerateReq]]
    echo_texts: list[str]  # per prompt, when echoing

    @property
    def msgs(self) -> list[TokenizedGenerateReq]:
        return [m for group in self.groups for m in group]

    def usage(self, metas: list[dict[str, Any]]) -> dict[str, Any]:
        return samples_usage([len(g[0].input_ids) for g in self.groups], [len(g) for g in self.groups], metas)

    def echo(self, index: int) -> str:
        return self.echo_texts[index // self.body.n] if self.body.echo else ""


class Completions:
    def __init__(self, api: OpenAIContext):
        self.api = api

    async def completions(self, request: Request) -> Response:  # the name is the OpenAPI summary
        try:
            body = await parse_body(request, CompletionRequest)
            body.check_unsupported()
            job = await asyncio.to_thread(self._job, body)  # tokenizing off the event loop
        except OpenAIError as e:
            return error_response(e)
        runner = await open_runner(self.api.tm_getter(), job.msgs, _RENAMES,
                                   (lambda e: error_events(e, _RENAMES)) if body.stream else None)
        if isinstance(runner, Response):
            return runner
        envelope = self.api.envelope("cmpl", "text_completion", job.msgs[0].lora_path)
        if body.stream:
            return EventStream(self._stream(runner, job, envelope), on_close=runner.close)
        wholes = await run_whole(request, runner, runner.whole_results(), _RENAMES)
        if isinstance(wholes, Response):
            return wholes
        choices = []
        for index, out in enumerate(wholes):
            meta, logprobs = out["meta_info"], None
            if body.logprobs is not None:
                entries = (logprob_entries(meta, "input") if body.echo else []) + logprob_entries(meta, "output")
                logprobs, _ = completion_logprobs(self.api.names(), entries, 0)
            choices.append(choice(meta, index=index, text=job.echo(index) + out["text"], logprobs=logprobs))
        return json_response({**envelope, "choices": choices, "usage": job.usage([o["meta_info"] for o in wholes])})

    def _job(self, body: CompletionRequest) -> _Job:
        tm = self.api.tm_getter()
        groups, echo_texts = [], []
        for prompt in body.prompts():
            ids = tokenize(tm, prompt, _RENAMES)
            max_new = 16 if body.max_tokens is None else body.max_tokens
            check_fits(tm, len(ids), max_new, "max_tokens")
            groups.append(samples(tm, ids, body.sampling_params(max_new), _RENAMES,
                                  return_logprob=body.logprobs is not None,
                                  logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
                                  top_logprobs_num=body.logprobs or 0, stream=body.stream,
                                  cache_salt=body.cache_salt, lora_path=adapter_of(tm, body.model),
                                  session_id=body.session_id))
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else tm.tokenizer.decode(ids))
        return _Job(body, groups, echo_texts)

    async def _stream(self, runner: RequestRunner, job: _Job, envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        body, n = job.body, len(job.msgs)
        echoed = [False] * n
        offsets = [0] * n  # characters of each choice sent so far, for text_offset
        finals: list[Any] = [None] * n
        try:
            async for index, chunk in runner.chunks():
                meta, text = chunk["meta_info"], chunk["text"]
                if not echoed[index]:
                    text, echoed[index] = job.echo(index) + text, True
                logprobs = None
                if body.logprobs is not None:
                    entries = (logprob_entries(meta, "input") if body.echo else []) + logprob_entries(meta, "output")
                    logprobs, offsets[index] = completion_logprobs(self.api.names(), entries, offsets[index])
                finish = finish_reason_of(meta)
                if finish is not None:
                    finals[index] = meta
                if text or finish is not None or (logprobs and logprobs["tokens"]):
                    yield sse({**envelope, "choices": [choice(meta, index=index, text=text, logprobs=logprobs)]})
            if body.include_usage:
                yield sse({**envelope, "choices": [], "usage": job.usage(finals)})
            yield SSE_DONE
        except Exception as e:
            yield sse(as_openai_error(e, _RENAMES).body())
            yield SSE_DONE
        finally:
            await runner.close()

