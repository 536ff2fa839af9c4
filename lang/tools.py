"""Tools in the language: `gen("call", tools=[...])`, and `separate_reasoning`.

Tools are OpenAI-style dicts, pydantic model classes or plain functions (their schema comes
from the signature, their descriptions from the docstring). Everything a chat request does
with them is the server's own code (radixlm.srt.server.tool_calls and chat.py, pure Python),
so a program's tools reach the prompt, constrain decoding and are read back exactly as on
/v1/chat/completions. This module loads that code; ir.py imports it only for a gen that uses
it, so a program without tools loads nothing of radixlm.srt.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .backend import BackendError
from .chat_template import ChatRenderer
from .sampling import SglSamplingParams
from .srt.server.chat import ChatTurn
from .srt.server.tool_calls.parsers import default_parser_name
from .srt.server.tool_calls.reasoning import check_parser, prompt_opens_think
from .srt.server.tool_calls.requests import ToolRequest, call_schema, check_tools, render_inputs
from .tokenizer import render_chat_template

# ---- tool specs ------------------------------------------------------------------------------

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SUPPORTED = "str, int, float, bool, None, list[...], dict[str, ...], Literal[...], an Enum, or a union of these"


def tool_spec(tool: Any) -> dict[str, Any]:
    """The OpenAI-style dict of a tool given as such a dict, a pydantic model class or a function."""
    if isinstance(tool, dict):
        return tool
    if isinstance(tool, type) and hasattr(tool, "model_json_schema"):
        parameters = dict(tool.model_json_schema())
        parameters.pop("title", None)  # the name and description say it already
        return _function(tool.__name__, parameters.pop("description", None), parameters)
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return function_spec(tool)
    raise TypeError(f"tools: a tool is an OpenAI-style dict, a pydantic model class or a function, not {tool!r}")


def function_spec(fn: Any) -> dict[str, Any]:
    """A function's tool dict: each parameter's schema from its type hint, its description
    from the docstring (Google-style `Args:` or `:param name:`); a parameter without a default
    is required. Raises TypeError naming a parameter whose type cannot become a schema."""
    name = fn.__name__
    summary, described = _docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation naming something undefined, ...
        raise TypeError(f"tool {name}: cannot resolve its type hints ({e})") from None
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool {name}: parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{where}: *args and **kwargs cannot become a JSON schema")
        if param.name not in hints:
            raise TypeError(f"{where} has no type hint (a tool's parameters need one: {_SUPPORTED})")
        schema = type_schema(hints[param.name], where)
        if param.name in described:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    return _function(name, summary, {"type": "object", "properties": properties, "required": required})


def type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a type hint; TypeError (saying `where`) for one without."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list:
        return {"type": "array", **({"items": type_schema(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, not {args[0]!r}")
        return {"type": "object", **({"additionalProperties": type_schema(args[1], where)} if args else {})}
    if origin is Literal:
        return _enum(list(args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum([member.value for member in hint])
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [type_schema(arg, where) for arg in args]}
    raise TypeError(f"{where}: the type {hint!r} cannot become a JSON schema (use {_SUPPORTED})")


def _enum(values: list[Any]) -> dict[str, Any]:
    kinds = {_SCALARS.get(type(v)) for v in values}
    return {"type": kinds.pop(), "enum": values} if len(kinds) == 1 and None not in kinds else {"enum": values}


def _function(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": name, **({"description": description} if description else {}), "parameters": parameters}
    return {"type": "function", "function": fn}


_SECTION = re.compile(r"(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):")
_ARG = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")  # `name (type): text`
_PARAM = re.compile(r":param\s+(?:[^:]*\s)?(\w+):\s*(.*)")  # `:param [type] name: text`


def _docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the text before any section, {parameter: description}); continuation lines (indented
    deeper than the entry) join the entry."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section, current, entry_indent = None, None, 0
    for line in doc.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if (match := _PARAM.fullmatch(text)) is not None:
            section, current, entry_indent = ":param", match.group(1), indent
            described[current] = match.group(2)
        elif _SECTION.fullmatch(text) or text.startswith(":"):
            section, current = text.rstrip(":"), None
        elif section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and (match := _ARG.fullmatch(text)) \
                and (current is None or indent <= entry_indent):
            current, entry_indent = match.group(1), indent
            described[current] = match.group(2)
        elif current is not None and text and indent > entry_indent:
            described[current] = f"{described[current]} {text}".strip()
    return "\n".join(summary).strip(), described


# ---- what a gen reads from its output ----------------------------------------------------------

@dataclass(frozen=True)
class OutputReader:
    """A gen's tools (the server's ToolRequest) and/or its think-block format."""

    tools: ToolRequest | None = None
    reasoning: str | None = None  # separate_reasoning's model_type

    def chat(self, backend: Any) -> "ToolChat":
        """The renderer of this gen's conversation: the server's chat template, with the tools."""
        model_info = getattr(backend, "get_model_info", None)
        if model_info is None:
            raise ValueError(f"gen(tools=...): the {type(backend).__name__} backend cannot render tools as the "
                             f"server does; use RuntimeEndpoint or Runtime")
        info = model_info()
        if not info.get("chat_template"):
            raise BackendError("gen(tools=...) needs the model's chat template, and the server reports none")
        return ToolChat(info["chat_template"], dict(info.get("special_tokens") or {}), self.tools,
                        f"chat template of {info.get('model_path')}")

    def constrain(self, params: SglSamplingParams) -> SglSamplingParams:
        """A required or named call is decoded under the JSON schema of the calls."""
        if (params.n or 1) != 1:
            raise ValueError("gen with tools or separate_reasoning generates one sample (n=1)")
        if self.tools is None or not self.tools.constrained:
            return params
        if params.regex is not None or params.json_schema is not None or params.dtype is not None:
            raise ValueError(f"gen(tool_choice={self.tools.choice!r}) is constrained to the tool calls; "
                             f"it takes no regex, json_schema or dtype")
        return dataclasses.replace(params, json_schema=call_schema(self.tools))

    def read(self, text: str, prompt: str, chat: ChatRenderer | None) -> tuple[Any, dict[str, Any]]:
        """(the gen's value, the assistant message /v1/chat/completions makes of the output:
        content, tool_calls and reasoning_content). The value: with tools, the calls as
        {"id", "name", "arguments": dict}; without, the answer."""
        template = chat.template if isinstance(chat, ToolChat) else None
        turn = ChatTurn(prompt, self.tools or ToolRequest(), default_parser_name(template), self.reasoning,
                        self.reasoning is not None and prompt_opens_think(prompt), None)
        message = turn.message(text)[0]
        if self.tools is None:
            return message["content"] or "", message
        return [{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message.get("tool_calls") or []], message


def tools_reader(tools: Any, tool_choice: Any) -> OutputReader:
    """gen(tools=..., tool_choice=...): ValueError/TypeError naming what is wrong."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise TypeError("gen(tools=...): tools is a non-empty list of dicts, pydantic model classes or functions")
    return OutputReader(tools=check_tools([tool_spec(t) for t in tools], tool_choice, None))


def reasoning_reader(reader: OutputReader | None, model_type: str) -> OutputReader:
    if reader is not None and reader.tools is not None and reader.tools.constrained:
        raise ValueError("separate_reasoning: a required or named tool call is constrained from its first token, "
                         "so it has no think block to separate")
    return dataclasses.replace(reader or OutputReader(), reasoning=check_parser(model_type))


class ToolChat(ChatRenderer):
    """Renders turns as /v1/chat/completions does with tools: `render_inputs` rewrites the
    messages (earlier calls and results; for a template without a tool section, the tools
    described in the system message), and the template renders them with its `tools` argument."""

    def __init__(self, template: str, special_tokens: dict[str, str], tools: ToolRequest, name: str):
        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            rendered, hf_tools = render_inputs(messages, tools, template)
            return render_chat_template(template, special_tokens, rendered, add_generation_prompt, tools=hf_tools)

        super().__init__(render, name)
        self.template = template
