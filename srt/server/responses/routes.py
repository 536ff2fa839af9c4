"""/v1/responses: the Responses API on top of the chat turn machinery.

A request's input (text, messages, function calls and their outputs) becomes chat messages,
after the stored conversation of `previous_response_id` and the request's `instructions`; the
turn runs as a chat completion with one choice, and its message comes back as output items
(reasoning, message, function calls), whole or as Responses stream events.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..chat import ChatOptions
from ..chat_run import ChatChoices, ChatRun, prepare_chat
from ..openai_common import (OpenAIContext, as_openai_error, error_response, json_response, open_runner,
                             parse_body, run_whole)
from ..openai_protocol import ChatCompletionRequest, OpenAIError, finish_reason_of
from ..streaming import EventStream
from ..tool_calls.parsers import ToolCall
from .protocol import (EventWriter, ResponsesRequest, function_call_item, input_messages, message_item,
                       new_id, reasoning_item, response_object, usage_of)
from .store import ResponseStore, StoredTurn

_RENAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "messages": "input", "json_schema": "text.format.schema"}


class ResponsesRoutes:
    def __init__(self, api: OpenAIContext, options: ChatOptions, store: ResponseStore | None = None):
        self.api = api
        self.options = options
        self.store = store or ResponseStore()

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])

    async def retrieve(self, response_id: str) -> Response:
        turn = self.store.get(response_id)
        if turn is None:
            return error_response(_not_found(response_id))
        return json_response(turn.response)

    async def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            return error_response(_not_found(response_id))
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, request: Request) -> Response:
        try:
            body = await parse_body(request, ResponsesRequest)
            history, run = await asyncio.to_thread(self._prepare, body)  # tokenizing off the event loop
        except OpenAIError as e:
            return error_response(e)
        response_id = new_id("resp")
        runner = await open_runner(self.api.tm_getter(), run.msgs, run.renames,
                                   (lambda e: self._failed(body, response_id, e)) if body.stream else None)
        if isinstance(runner, Response):
            return runner
        choices = ChatChoices(self.api.tm_getter(), run, runner)
        if body.stream:
            return EventStream(self._stream(body, history, choices, response_id), on_close=runner.close)
        finals = await run_whole(request, runner, choices.run_to_end(), run.renames)
        if isinstance(finals, Response):
            return finals
        final = finals[0]
        message, _ = run.turn.message(final["text"])
        output = _output_items(message)
        response = self._respond(body, response_id, output, choices, final)
        self._remember(body, history, message, response)
        return json_response(response)

    def _prepare(self, body: ResponsesRequest) -> tuple[list[dict[str, Any]], ChatRun]:
        """(the conversation so far as messages, this turn's input included; the chat run)."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise OpenAIError(f"previous_response_id: no stored response {body.previous_response_id!r}",
                                  "previous_response_id", status=404)
            history = list(stored.messages)
        try:
            history += input_messages(body)
            chat = {"messages": ([{"role": "system", "content": body.instructions}] if body.instructions else [])
                    + history, "stream": bool(body.stream)}
            for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                                ("top_p", body.top_p), ("tools", body.chat_tools()),
                                ("tool_choice", body.chat_tool_choice()),
                                ("parallel_tool_calls", body.parallel_tool_calls), ("seed", body.seed),
                                ("cache_salt", body.cache_salt)):
                if value is not None:
                    chat[name] = value
            schema = body.json_schema()
            if schema is not None:
                chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
            request = ChatCompletionRequest.model_validate(chat)
        except ValueError as e:
            raise OpenAIError.from_value_error(e, {}) if not isinstance(e, ValidationError) \
                else OpenAIError.from_validation_error(e) from None
        try:
            return history, prepare_chat(self.api.tm_getter(), request, self.options)
        except OpenAIError as e:
            raise _renamed(e) from None

    def _respond(self, body: ResponsesRequest, response_id: str, output: list[dict[str, Any]],
                 choices: ChatChoices, final: dict[str, Any]) -> dict[str, Any]:
        usage = choices.usage()
        cut = finish_reason_of(final["meta_info"]) == "length"
        return response_object(body, response_id, self.api.model_name, output,
                               usage_of(usage["prompt_tokens"], usage["completion_tokens"],
                                        usage["prompt_tokens_details"]["cached_tokens"]),
                               status="incomplete" if cut else "completed",
                               incomplete_reason="max_output_tokens" if cut else None)

    def _remember(self, body: ResponsesRequest, history: list[dict[str, Any]], message: dict[str, Any],
                  response: dict[str, Any]) -> None:
        if body.store is False:
            return
        said = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            said["tool_calls"] = message["tool_calls"]
        self.store.put(response["id"], StoredTurn(history + [said], body.instructions, response))

    async def _failed(self, body: ResponsesRequest, response_id: str, e: Exception) -> AsyncIterator[bytes]:
        """A stream whose request could not start: it opens as any other, then fails."""
        events = EventWriter()
        started = response_object(body, response_id, self.api.model_name, [], None, status="in_progress")
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        error = as_openai_error(e, _RENAMES)
        yield events.event("error", code=error.code, message=error.message, param=error.param)

    async def _stream(self, body: ResponsesRequest, history: list[dict[str, Any]], choices: ChatChoices,
                      response_id: str) -> AsyncIterator[bytes]:
        events = EventWriter()
        items = _StreamedItems(events)
        started = response_object(body, response_id, self.api.model_name, [], None, status="in_progress")
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        final = None
        try:
            async for event in choices.events():
                for chunk in items.apply(event.deltas + event.closing):
                    yield chunk
                if event.final:
                    final = event.chunk
        except Exception as e:
            error = as_openai_error(e, _RENAMES)
            yield events.event("error", code=error.code, message=error.message, param=error.param)
            return
        finally:
            await choices.runner.close()
        for chunk in items.close_all():
            yield chunk
        response = self._respond(body, response_id, items.output, choices, final)
        message = _message_of(items.output)
        self._remember(body, history, message, response)
        yield events.event("response.completed", response=response)


class _StreamedItems:
    """Output items opened and closed as chat deltas arrive, with their Responses events."""

    def __init__(self, events: EventWriter):
        self.events = events
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its function_call item
        # Item id -> the text (or a call's arguments) so far, joined once, when the item closes.
        self._pieces: dict[str, list[str]] = {}

    def apply(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._ensure("reasoning")
                item, piece = self.open, delta["reasoning_content"]
                self._pieces[item["id"]].append(piece)
                out.append(self._event("response.reasoning_text.delta", item, content_index=0, delta=piece))
            if delta.get("content"):
                out += self._ensure("message")
                item, piece = self.open, delta["content"]
                self._pieces[item["id"]].append(piece)
                out.append(self._event("response.output_text.delta", item, content_index=0, delta=piece, logprobs=[]))
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def close_all(self) -> list[bytes]:
        out = self._close_open()
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                item["arguments"] = "".join(self._pieces.pop(item["id"]))
                out.append(self._event("response.function_call_arguments.done", item, arguments=item["arguments"],
                                       name=item["name"]))
                out.append(self._item_event("response.output_item.done", item))
        return out

    def _ensure(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close_open()
        item = reasoning_item("") if kind == "reasoning" else message_item("", status="in_progress")
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = item
        self._pieces[item["id"]] = []
        out.append(self._item_event("response.output_item.added", item))
        part = item["content"][0]
        out.append(self._event("response.content_part.added", item, content_index=0, part={**part, "text": ""}))
        return out

    def _close_open(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        part = item["content"][0]
        part["text"] = "".join(self._pieces.pop(item["id"]))
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self._event(done, item, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item, content_index=0, part=part),
                self._item_event("response.output_item.done", item)]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = call["index"]
        fn = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close_open()
            item = function_call_item(ToolCall(fn.get("name", ""), "", call.get("id", "")), status="in_progress")
            self.calls[index] = item
            self.output.append(item)
            self._pieces[item["id"]] = []
            out.append(self._item_event("response.output_item.added", item))
        piece = fn.get("arguments") or ""
        if piece:
            self._pieces[item["id"]].append(piece)
            out.append(self._event("response.function_call_arguments.delta", item, delta=piece))
        return out

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> bytes:
        return self.events.event(kind, item_id=item["id"], output_index=self.output.index(item), **fields)

    def _item_event(self, kind: str, item: dict[str, Any]) -> bytes:
        return self.events.event(kind, output_index=self.output.index(item), item=item)


def _output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(function_call_item(ToolCall(fn["name"], fn["arguments"], call["id"])))
    return items


def _message_of(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a streamed output amounts to (for the stored conversation)."""
    text = "".join(i["content"][0]["text"] for i in output if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-completions field name in an error, as the Responses request names it."""
    if e.param is None:
        return e
    head, dot, tail = e.param.partition(".")
    base = head.split("[")[0]
    if base not in _RENAMES:
        return e
    param = _RENAMES[base] + head[len(base):] + dot + tail
    return OpenAIError(e.message.replace(e.param, param, 1), param, e.status, e.err_type, e.code)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"response_id: no stored response {response_id!r}", "response_id", status=404)

