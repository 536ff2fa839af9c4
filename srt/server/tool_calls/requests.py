"""A chat request's tools: checked, rendered into the prompt, and turned into a decoding
constraint when the call is not optional.

- `auto`: the model decides; its output is parsed in its family's format (parsers.py).
- `none`: tools are not shown to the model; the output is plain content.
- `required` / a named function: decoding is constrained (a JSON schema, compiled by
  xgrammar) to a list of calls, or to the named function's arguments, so the arguments always
  parse and match the function's parameters, whatever the model.

A template with a tool section gets the tools as HF's `apply_chat_template(tools=...)` passes
them; for one without (the default SmolLM2), the tools are described in the system message,
with the Hermes `<tool_call>` format, and earlier calls and results are written in that format.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ...constrained.spec import check_json_schema
from .parsers import ToolCall, new_call_id

_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools. `forced` is the named function, when one is."""

    functions: list[Function] = field(default_factory=list)
    choice: str = "auto"  # auto | none | required | named
    forced: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.active and self.choice in ("required", "named")

    def names(self) -> list[str]:
        return [f.name for f in self.functions]


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolRequest:
    """Raises ValueError naming the field for tools or a tool_choice we cannot honour."""
    functions = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-'")
        if name in {f.name for f in functions}:
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
        description = fn.get("description")
        functions.append(Function(name, description if isinstance(description, str) else None, params))
    choice, forced = _choice(tool_choice, functions)
    request = ToolRequest(functions, choice, forced, True if parallel is None else bool(parallel))
    if request.constrained:
        for i, fn in enumerate(functions):
            if forced is None or fn.name == forced:
                check_json_schema(fn.parameters, f"tools[{i}].function.parameters")
    return request


def _choice(tool_choice: Any, functions: list[Function]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ValueError("tool_choice: must be 'auto', 'none', 'required' or a function")
        if tool_choice == "required" and not functions:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return tool_choice, None
    name = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" \
            else tool_choice.get("name")
    if not isinstance(name, str):
        raise ValueError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {f.name for f in functions}:
        raise ValueError(f"tool_choice: no tool named {name!r} in tools")
    return "named", name


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every tool result answers a call an earlier assistant message made."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                call_ids.add(call["id"])
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers")
            if call_id not in call_ids:
                raise ValueError(f"messages[{i}].tool_call_id: no earlier assistant tool call has id {call_id!r}")


# ---- the prompt ---------------------------------------------------------------------------------

def template_has_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_inputs(messages: list[dict[str, Any]], tools: ToolRequest,
                  chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools argument) for apply_chat_template."""
    messages = copy.deepcopy(messages)
    if template_has_tools(chat_template):
        for message in messages:  # templates write arguments with tojson: give them objects
            for call in message.get("tool_calls") or []:
                fn = call.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = _loads_or_raw(fn["arguments"])
        hf_tools = [{"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                      "parameters": f.parameters}} for f in tools.functions]
        return messages, (hf_tools if tools.active else None)
    out = []
    for message in messages:
        if message.get("tool_calls"):
            text = message.get("content") or ""
            for call in message["tool_calls"]:
                fn = call.get("function", {})
                body = {"name": fn.get("name"), "arguments": _loads_or_raw(fn.get("arguments") or "{}")}
                text += ("\n" if text else "") + f"<tool_call>\n{json.dumps(body)}\n</tool_call>"
            message = {"role": message["role"], "content": text}
        elif message.get("role") == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        elif message.get("content") is None:
            message = {**message, "content": ""}
        out.append(message)
    if tools.active:
        out = _with_tool_instructions(out, tools)
    return out, None


def _with_tool_instructions(messages: list[dict[str, Any]], tools: ToolRequest) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters})
                        for f in tools.functions)
    instructions = ("You can call these functions:\n" + listing + "\nTo call one, reply with "
                    "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>")
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}] + messages[1:]
    return [{"role": "system", "content": instructions}] + messages


def _loads_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- constrained calls ----------------------------------------------------------------------------

def call_schema(tools: ToolRequest) -> dict[str, Any]:
    """The JSON schema a constrained output follows: the named function's arguments, or a
    list of {"name", "arguments"} calls (one, unless parallel calls are allowed)."""
    if tools.choice == "named":
        return next(f.parameters for f in tools.functions if f.name == tools.forced)
    variants = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in tools.functions]
    schema: dict[str, Any] = {"type": "array", "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
                              "minItems": 1}
    if not tools.parallel:
        schema["maxItems"] = 1
    return schema


def constrained_calls(tools: ToolRequest, text: str) -> list[ToolCall]:
    """The calls in a constrained output (the grammar guarantees its shape; a cut-off output,
    e.g. at max_tokens, yields none)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if tools.choice == "named":
        return [ToolCall(tools.forced, json.dumps(value, ensure_ascii=False), new_call_id())]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False), new_call_id()) for c in value]
