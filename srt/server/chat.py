"""A chat turn: messages and tools rendered into the prompt, and the model's text read back
as an assistant message (content, tool calls, reasoning), whole or streamed.

Shared by /v1/chat/completions and /v1/responses. The output is read in three layers: the
reasoning parser takes the think block first, then either the tool-call parser (tool_choice
auto) or the constrained-call reader (required / named) takes what follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .tool_calls.parsers import (StreamingToolParser, ToolCall, default_parser_name, new_call_id,
                                 parser_for)
from .tool_calls.reasoning import (CLOSE, StreamingReasoning, check_parser, prompt_opens_think,
                                   split_reasoning)
from .tool_calls.requests import (ToolRequest, call_schema, check_tool_messages, check_tools,
                                  constrained_calls, render_inputs)


@dataclass(frozen=True)
class ChatOptions:
    """Server-wide: `--tool-call-parser` (None: follow the chat template) and `--reasoning-parser`."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            parser_for(self.tool_call_parser, [])  # raises for an unknown name
        if self.reasoning_parser is not None:
            check_parser(self.reasoning_parser)


@dataclass(frozen=True)
class ChatTurn:
    prompt: str  # the rendered chat, ending with the assistant's generation prompt
    tools: ToolRequest
    parser_name: str
    reasoning: str | None  # the reasoning parser, if the server has one
    opens_think: bool  # the prompt ends inside a think block
    json_schema: str | None  # what decoding is constrained to (a tool call, or response_format)

    @property
    def constrain_after_reasoning(self) -> bool:
        """A constraint applies to the answer, not the think block before it: generate the
        reasoning first, then the constrained answer after it."""
        return (self.json_schema is not None and self.reasoning is not None
                and (self.opens_think or self.reasoning == "deepseek-r1"))

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a complete output, and whether it calls tools."""
        reasoning, answer = self._split(text)
        content, calls = self._read_answer(answer)
        if self.reasoning is not None and not content:
            content = None  # all of it was reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message, bool(calls)

    def _split(self, text: str) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        split = split_reasoning(self.reasoning, text, self.opens_think)
        return split.reasoning, split.content or ""

    def _read_answer(self, answer: str) -> tuple[str | None, list[ToolCall]]:
        if self.tools.constrained:
            calls = constrained_calls(self.tools, answer)
            return (None if calls else answer or None), calls
        if self.tools.active:
            parsed = parser_for(self.parser_name, self.tools.names()).parse(answer)
            return parsed.content, parsed.calls
        return answer, []

    def stream(self) -> ChatStream:
        return ChatStream(self)


def prepare_turn(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 tool_choice: Any, parallel_tool_calls: bool | None, options: ChatOptions,
                 response_schema: str | None = None, image_token: str | None = None) -> ChatTurn:
    """Raises ValueError naming the field for tools, tool messages or a template that refuses.
    image_token: a vision-language model's image placeholder (messages may hold image parts)."""
    request = check_tools(tools, tool_choice, parallel_tool_calls)
    check_tool_messages(messages)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    rendered_messages, hf_tools = render_inputs(messages, request, template)
    if image_token is not None:
        rendered_messages = image_content(rendered_messages, image_token, template)
    try:
        prompt = tokenizer.apply_chat_template(rendered_messages, tools=hf_tools, add_generation_prompt=True,
                                               tokenize=False)
    except Exception as e:  # the template's own checks (role order, ...) fail with assorted types
        raise ValueError(f"messages: the chat template rejected them: {e}") from None
    schema = response_schema
    if request.constrained:
        if response_schema is not None:
            raise ValueError("response_format: cannot be combined with a required or named tool_choice")
        schema = json.dumps(call_schema(request))
    parser = options.tool_call_parser or default_parser_name(template)
    return ChatTurn(prompt, request, parser, options.reasoning_parser,
                    options.reasoning_parser is not None and prompt_opens_think(prompt), schema)


def image_content(messages: list[dict[str, Any]], image_token: str, template: str) -> list[dict[str, Any]]:
    """Messages with image parts ({"type": "image"}), as the template renders them: a template
    that writes image parts itself (LLaVA's, which emit the image token) gets every content as
    a list of parts; any other gets strings, with the image token where each image was."""
    renders_images = "'image'" in template or '"image"' in template
    out = []
    for message in messages:
        content = message.get("content")
        if renders_images and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not renders_images and isinstance(content, list):
            content = "".join(image_token if part["type"] == "image" else part["text"] for part in content)
        out.append({**message, "content": content})
    return out


def after_reasoning(turn: ChatTurn, reasoning_text: str) -> str:
    """The prompt for the constrained answer once the reasoning was generated (it stopped at
    the closing tag, which the stop-string trim removed)."""
    opener = "" if turn.opens_think else "<think>\n"
    return f"{turn.prompt}{opener if not reasoning_text.lstrip().startswith('<think>') else ''}{reasoning_text}{CLOSE}\n\n"


class ChatStream:
    """Turns streamed text into chat deltas: reasoning_content, content and tool_calls."""

    def __init__(self, turn: ChatTurn):
        self.turn = turn
        self.reasoning = StreamingReasoning(turn.reasoning, turn.opens_think) if turn.reasoning else None
        auto = turn.tools.active and not turn.tools.constrained
        self.tool_parser = StreamingToolParser(parser_for(turn.parser_name, turn.tools.names())) if auto else None
        self.answer = ""  # constrained output, read when complete (or streamed as the named call's arguments)
        self.named_id: str | None = None
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._answer(text)
        reasoning, content = self.reasoning.feed(text)
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        return deltas + (self._answer(content) if content else [])

    def feed_answer(self, text: str) -> list[dict[str, Any]]:
        """Text known to be the answer (the second phase of a constrained turn)."""
        return self._answer(text) if text else []

    def feed_reasoning(self, text: str) -> list[dict[str, Any]]:
        """Text known to be reasoning (the first phase of a constrained turn)."""
        return [{"reasoning_content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
            if content:
                deltas += self._answer(content)
        if self.tool_parser is not None:
            parsed = self.tool_parser.finish()
            if parsed.content:
                deltas.append({"content": parsed.content})
            deltas += self._call_deltas(parsed.calls)
        elif self.turn.tools.constrained and self.turn.tools.choice != "named":
            calls = constrained_calls(self.turn.tools, self.answer)
            deltas += self._call_deltas(calls) if calls else ([{"content": self.answer}] if self.answer else [])
        return deltas

    @property
    def called_tools(self) -> bool:
        return self.calls > 0

    def _answer(self, text: str) -> list[dict[str, Any]]:
        tools = self.turn.tools
        if self.tool_parser is not None:
            content = self.tool_parser.feed(text)
            return [{"content": content}] if content else []
        if tools.constrained:
            self.answer += text
            if tools.choice != "named":
                return []
            deltas = []
            if self.named_id is None:  # the forced call opens with its name, arguments follow
                self.named_id, self.calls = new_call_id(), 1
                deltas.append({"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                               "function": {"name": tools.forced, "arguments": ""}}]})
            return deltas + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        return [{"content": text}]

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append({"tool_calls": [{"index": self.calls, **call.to_openai()}]})
            self.calls += 1
        return deltas
