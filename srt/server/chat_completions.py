"""/v1/chat/completions: a chat turn run by ChatChoices (chat_run.py), answered whole or
streamed as OpenAI does, with tool calls and reasoning content."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from .chat import ChatOptions
from .chat_run import REASONING, ChatChoices, ChatRun, prepare_chat
from .openai_common import (OpenAIContext, as_openai_error, error_events, error_response, json_response,
                            open_runner, parse_body, run_whole)
from .openai_protocol import (ChatCompletionRequest, OpenAIError, chat_logprobs, choice, logprob_entries)
from .streaming import SSE_DONE, EventStream, sse


class ChatCompletions:
    def __init__(self, api: OpenAIContext, options: ChatOptions):
        self.api = api
        self.options = options

    async def create(self, request: Request) -> Response:
        try:
            body = await parse_body(request, ChatCompletionRequest)
            body.check_unsupported()
            tm = self.api.tm_getter()
            run = await asyncio.to_thread(prepare_chat, tm, body, self.options)  # tokenizing off the loop
        except OpenAIError as e:
            return error_response(e)
        runner = await open_runner(tm, run.msgs, run.renames,
                                   (lambda e: error_events(e, run.renames)) if body.stream else None)
        if isinstance(runner, Response):
            return runner
        choices = ChatChoices(tm, run, runner)
        envelope = self.api.envelope("chatcmpl", "chat.completion", run.msgs[0].lora_path)
        if body.stream:
            envelope["object"] = "chat.completion.chunk"
            return EventStream(self._stream(choices, envelope), on_close=runner.close)
        wholes = await run_whole(request, runner, choices.run_to_end(), run.renames)
        if isinstance(wholes, Response):
            return wholes
        items = []
        for index, out in enumerate(wholes):
            meta = out["meta_info"]
            message, called = run.turn.message(out["text"])
            logprobs = None
            if body.logprobs:
                logprobs = {"content": chat_logprobs(self.api.names(), logprob_entries(meta, "output"))}
            item = choice(meta, index=index, message=message, logprobs=logprobs)
            if called and item["finish_reason"] == "stop":
                item["finish_reason"] = "tool_calls"
            items.append(item)
        return json_response({**envelope, "choices": items, "usage": choices.usage()})

    async def _stream(self, choices: ChatChoices, envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        run: ChatRun = choices.run

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None) -> bytes:
            return sse({**envelope, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": None}]})

        try:
            for index in range(run.body.n):
                yield chunk(index, {"role": "assistant", "content": ""})
            async for event in choices.events():
                index, deltas = event.index, event.deltas
                entries = logprob_entries(event.chunk["meta_info"], "output") if event.phase != REASONING else []
                if run.body.logprobs and entries:
                    yield chunk(index, deltas[0] if deltas else {"content": ""},
                                logprobs={"content": chat_logprobs(self.api.names(), entries)})
                    deltas = deltas[1:]
                for delta in deltas + event.closing:
                    yield chunk(index, delta)
                if event.final:
                    yield self._final_chunk(envelope, index, event.chunk["meta_info"], choices.called_tools(index))
            if run.body.include_usage:
                yield sse({**envelope, "choices": [], "usage": choices.usage()})
            yield SSE_DONE
        except Exception as e:
            yield sse(as_openai_error(e, run.renames).body())
            yield SSE_DONE
        finally:
            await choices.runner.close()

    @staticmethod
    def _final_chunk(envelope: dict[str, Any], index: int, meta: dict[str, Any], called_tools: bool) -> bytes:
        item = choice(meta, index=index, delta={}, logprobs=None)
        if called_tools and item["finish_reason"] == "stop":
            item["finish_reason"] = "tool_calls"
        return sse({**envelope, "choices": [item]})
