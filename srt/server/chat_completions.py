"""/v1/chat/completions: a chat turn (chat.py) run through the intake and the sample runner,
answered whole or streamed as OpenAI does, with tool calls and reasoning content.

A turn whose answer is constrained (tool_choice required or named, response_format) while the
server parses reasoning runs in two phases per choice: the reasoning, stopped at its closing
tag, then the constrained answer after it (its prompt extends the first, so it hits the cache).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from .chat import ChatOptions, ChatTurn, after_reasoning, prepare_turn
from .openai_api import OpenAIServing
from .openai_common import (as_openai_error, check_fits, error_response, json_response, parse_body,
                            samples, tokenize)
from .openai_protocol import (ChatCompletionRequest, OpenAIError, chat_logprobs, choice,
                              finish_reason_of, logprob_entries)
from .openai_runner import Job, SampleRunner
from .run_to_end import run_to_end
from .streaming import SSE_DONE, EventStream, sse
from .tool_calls.reasoning import CLOSE

_RENAMES = {"min_new_tokens": "min_tokens", "text": "messages", "input_ids": "messages",
            "top_logprobs_num": "top_logprobs"}


@dataclass
class ChatRun:
    """A prepared request: its turn and how to sample it."""

    body: ChatCompletionRequest
    turn: ChatTurn
    renames: dict[str, str]
    max_new: int
    first_job: Job  # the whole request, or the reasoning phase of a two-phase one
    # Per choice: the final result of each phase, for usage.
    finals: dict[int, dict[str, Any]] = field(default_factory=dict)
    reasoning_finals: dict[int, dict[str, Any]] = field(default_factory=dict)

    def usage(self) -> dict[str, Any]:
        outs = [self.finals[i] for i in sorted(self.finals)]
        if not self.turn.constrain_after_reasoning:
            return self.first_job.usage(outs)
        firsts = [self.reasoning_finals[i]["meta_info"] for i in sorted(self.reasoning_finals)]
        prompt = firsts[0]["prompt_tokens"] if firsts else 0
        completion = sum(m["completion_tokens"] for m in firsts) + sum(
            o["meta_info"]["completion_tokens"] for i, o in self.finals.items() if o is not self.reasoning_finals.get(i))
        cached = min((m["cached_tokens"] for m in firsts), default=0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class ChatCompletions:
    def __init__(self, api: OpenAIServing, options: ChatOptions):
        self.api = api
        self.options = options

    async def create(self, request: Request) -> Response:
        try:
            body = await parse_body(request, ChatCompletionRequest)
            body.check_unsupported()
            run = await asyncio.to_thread(self.prepare, body)  # tokenizing a long chat must not block the loop
        except OpenAIError as e:
            return error_response(e)
        envelope = self.api.envelope("chatcmpl", "chat.completion")
        if body.stream:
            envelope["object"] = "chat.completion.chunk"
            return EventStream(self._stream(run, envelope))
        finals = await self.run_to_end(run, request)
        if isinstance(finals, Response):
            return finals
        choices = []
        for index, out in enumerate(finals):
            meta = out["meta_info"]
            message, called = run.turn.message(out["text"])
            logprobs = None
            if body.logprobs:
                logprobs = {"content": chat_logprobs(self.api.names(), logprob_entries(meta, "output"))}
            item = choice(meta, index=index, message=message, logprobs=logprobs)
            if called and item["finish_reason"] == "stop":
                item["finish_reason"] = "tool_calls"
            choices.append(item)
        return json_response({**envelope, "choices": choices, "usage": run.usage()})

    # ---- preparing -------------------------------------------------------------------------------

    def prepare(self, body: ChatCompletionRequest) -> ChatRun:
        tm = self.api.tm_getter()
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        renames = {**_RENAMES, "max_new_tokens": max_field}
        messages = [m.as_dict(i) for i, m in enumerate(body.messages)]
        response_schema = body.schema_from_response_format()
        try:
            turn = prepare_turn(tm.tokenizer, messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                                self.options, response_schema)
        except ValueError as e:
            raise OpenAIError.from_value_error(e, renames) from None
        if turn.tools.constrained:
            renames["json_schema"] = "tools"
        elif response_schema is not None:
            json_object = body.response_format.type == "json_object"
            renames["json_schema"] = "response_format" if json_object else "response_format.json_schema.schema"
        ids = tokenize(tm, turn.prompt, renames)  # the template already holds BOS and special tokens
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_new is None:
            max_new = tm.context_len - len(ids)
        check_fits(tm, len(ids), max_new, max_field)
        run = ChatRun(body, turn, renames, max_new, Job([], [], renames))
        if turn.constrain_after_reasoning:
            run.first_job = self._job(run, ids, max_new, None, stop=[CLOSE], n=1)
        else:
            run.first_job = self._job(run, ids, max_new, turn.json_schema, n=body.n)
        return run

    def _job(self, run: ChatRun, ids: list[int], max_new: int, schema: str | None, stop: list[str] = (),
             n: int = 1, seed_offset: int = 0) -> Job:
        body = run.body
        params = body.sampling_params(max_new)
        params["n"] = n
        if schema is not None:
            params["json_schema"] = schema
        if stop:
            existing = params.get("stop") or []
            params["stop"] = ([existing] if isinstance(existing, str) else list(existing)) + list(stop)
        if seed_offset and params.get("seed") is not None:
            params["seed"] += seed_offset
        msgs = samples(self.api.tm_getter(), ids, params, run.renames, return_logprob=body.logprobs,
                       top_logprobs_num=body.top_logprobs or 0, stream=body.stream, cache_salt=body.cache_salt)
        return Job([msgs], [], run.renames)

    # ---- running ---------------------------------------------------------------------------------

    async def results(self, run: ChatRun) -> AsyncIterator[tuple[int, str, dict[str, Any]]]:
        """(choice index, phase "reasoning" or "answer", that phase's result so far), as they come."""
        tm = self.api.tm_getter()
        if not run.turn.constrain_after_reasoning:
            async for index, out in SampleRunner(tm, run.first_job).outputs():
                yield index, "answer", out
            return
        for index in range(run.body.n):
            job = run.first_job if index == 0 else self._job(run, run.first_job.groups[0][0].input_ids, run.max_new,
                                                             None, stop=[CLOSE], seed_offset=index)
            first = None
            async for _, out in SampleRunner(tm, job).outputs():
                first = out
                yield index, "reasoning", out
            run.reasoning_finals[index] = first
            reason = first["meta_info"].get("finish_reason") or {}
            left = run.max_new - first["meta_info"]["completion_tokens"]
            if reason.get("type") != "stop" or reason.get("matched") != CLOSE or left <= 0:
                continue  # it ended while reasoning: there is no answer to constrain
            ids = tokenize(tm, after_reasoning(run.turn, first["text"]), run.renames)
            answer = self._job(run, ids, left, run.turn.json_schema, seed_offset=index)
            async for _, out in SampleRunner(tm, answer).outputs():
                yield index, "answer", out

    async def run_to_end(self, run: ChatRun, request: Request) -> list[dict[str, Any]] | Response:
        """Each choice's final result (a two-phase choice's text holds its reasoning and
        answer), or the error response; stops everything if the client disconnects first."""
        finals = await run_to_end(request, self._whole_results(run), run.renames, run.body.n)
        if not isinstance(finals, Response):
            run.finals.update(enumerate(finals))
        return finals

    async def _whole_results(self, run: ChatRun) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """results() by choice, an answer after reasoning with the reasoning's text before it."""
        async for index, phase, out in self.results(run):
            if phase == "answer" and index in run.reasoning_finals:
                first = run.reasoning_finals[index]
                out = {**out, "text": first["text"] + CLOSE + out["text"]}
            yield index, out

    async def _stream(self, run: ChatRun, envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        n = run.body.n
        streams = [run.turn.stream() for _ in range(n)]
        sent_chars: dict[tuple[int, str], int] = {}
        sent_tokens = [0] * n

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None) -> bytes:
            return sse({**envelope, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": None}]})

        try:
            for index in range(n):
                yield chunk(index, {"role": "assistant", "content": ""})
            async for index, phase, out in self.results(run):
                meta = out["meta_info"]
                key = (index, phase)
                text = out["text"][sent_chars.get(key, 0):]
                sent_chars[key] = len(out["text"])
                finished = finish_reason_of(meta) is not None
                if phase == "reasoning":
                    for delta in streams[index].feed_reasoning(text):
                        yield chunk(index, delta)
                    if finished:
                        run.reasoning_finals[index] = out
                        run.finals.setdefault(index, out)
                        if (meta["finish_reason"] or {}).get("matched") != CLOSE:
                            yield self._final_chunk(envelope, index, meta, streams[index])
                    continue
                entries = logprob_entries(meta, "output")[sent_tokens[index]:]
                sent_tokens[index] += len(entries)
                answer_only = index in run.reasoning_finals
                deltas = streams[index].feed_answer(text) if answer_only else (streams[index].feed(text) if text else [])
                if run.body.logprobs and entries:
                    logprobs = {"content": chat_logprobs(self.api.names(), entries)}
                    yield chunk(index, deltas[0] if deltas else {"content": ""}, logprobs=logprobs)
                    deltas = deltas[1:]
                for delta in deltas:
                    yield chunk(index, delta)
                if finished:
                    run.finals[index] = out
                    for delta in streams[index].finish():
                        yield chunk(index, delta)
                    yield self._final_chunk(envelope, index, meta, streams[index])
            if run.body.include_usage:
                yield sse({**envelope, "choices": [], "usage": run.usage()})
            yield SSE_DONE
        except Exception as e:
            yield sse(as_openai_error(e, run.renames).body())
            yield SSE_DONE

    @staticmethod
    def _final_chunk(envelope: dict[str, Any], index: int, meta: dict[str, Any], stream: Any) -> bytes:
        item = choice(meta, index=index, delta={}, logprobs=None)
        if stream.called_tools and item["finish_reason"] == "stop":
            item["finish_reason"] = "tool_calls"
        return sse({**envelope, "choices": [item]})
