"""The language's expressions and the functions that build them (`gen`, `select`, roles, ...).

Expressions are plain data; the interpreter (`interpreter.py`) gives them meaning. `a + b`
concatenates expressions and strings into an `ExprList`, so `s += "Q: " + gen("a")` works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from .choices import ChoicesMethod, token_length_normalized
from .sampling import SglSamplingParams

if TYPE_CHECKING:
    from .tools import OutputReader


class Expr:
    """Base of every expression; supports `+` with strings and other expressions."""

    def __add__(self, other: Any) -> "ExprList":
        return ExprList([*_items(self), *_items(as_expr(other))])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([*_items(as_expr(other)), *_items(self)])


@dataclass(eq=False)
class Constant(Expr):
    value: str


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr]


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: SglSamplingParams
    reader: OutputReader | None = None  # tools / separate_reasoning: what to read from the output

    @property
    def tools(self) -> Any:  # the executors fetch the chat template before a gen with tools
        return self.reader.tools if self.reader is not None else None


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    method: ChoicesMethod = token_length_normalized
    lora_path: str | None = None  # None: the run's adapter, if any


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str
    call_id: str | None = None  # a tool result's: the call it answers


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str
    call_id: str | None = None


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class Image(Expr):
    """An image at this point of the text: the model's image token, its pixels sent beside."""
    data_url: str


@dataclass(eq=False)
class CommitPrefix(Expr):
    """Prefill the text so far into the server's cache (before a fork)."""


ExprLike = Union[str, Expr]


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if value is None:
        raise TypeError("cannot add None to a program state (a gen or select without a value?)")
    raise TypeError(f"can only add a str or an expression (gen, select, role, ...) to a program state, "
                    f"not {type(value).__name__}; convert it with str() first")


def _items(expr: Expr) -> list[Expr]:
    return list(expr.items) if isinstance(expr, ExprList) else [expr]


def names_in(expr: Expr) -> list[str]:
    """Variable names an expression will set (so readers can wait for them)."""
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in names_in(item)]
    if isinstance(expr, Gen) and expr.name is not None and expr.reader is not None and expr.reader.reasoning:
        return [expr.name, reasoning_name(expr.name)]
    if isinstance(expr, (Gen, Select)) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, VarScopeEnd):
        return [expr.name]
    return []


# ---- the public constructors ------------------------------------------------------------------

def gen(name: str | None = None, max_tokens: int | None = None, *, choices: list[str] | None = None,
        choices_method: ChoicesMethod | None = None, tools: list[Any] | None = None, tool_choice: Any = None,
        **params: Any) -> Expr:
    """Generate text into variable `name`. Keywords are sampling parameters (`stop`,
    `temperature`, `top_p`, `top_k`, `min_p`, `n`, `min_tokens`, `ignore_eos`, `return_logprob`,
    `regex`, ..., and `lora_path`: the LoRA adapter to generate with); they override the run's.
    With `choices`, this is `select`. With `tools` (OpenAI-style dicts, pydantic model classes
    or functions) and `tool_choice` ("auto", "required", "none" or {"type": "function",
    "function": {"name": ...}}), an assistant turn that may call them: the variable holds the
    calls, [{"id", "name", "arguments": dict}] ([] when the model answers in text)."""
    reader = None
    if tools is not None or tool_choice is not None:
        if choices is not None or tools is None:
            raise TypeError("gen(tool_choice=...) needs tools=[...], and gen(choices=...) takes no tools")
        from .tools import tools_reader  # loads the server's tool-call code: only programs with tools need it

        reader = tools_reader(tools, tool_choice)
    if choices is not None:
        temperature = params.pop("temperature", None)
        lora_path = params.pop("lora_path", None)
        if params or max_tokens is not None:
            extra = sorted(params) + (["max_tokens"] if max_tokens is not None else [])
            raise TypeError(f"gen(choices=...) selects a choice; it takes no sampling arguments {extra}")
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized, lora_path=lora_path)
    if choices_method is not None:
        raise TypeError("gen(choices_method=...) needs choices=[...]")
    return Gen(name, SglSamplingParams.from_kwargs({"max_new_tokens": max_tokens, **params}, "gen"), reader)


def gen_int(name: str | None = None, max_tokens: int | None = None, **params: Any) -> Expr:
    """An integer, as text (the runtime constrains the output to digits)."""
    return Gen(name, SglSamplingParams.from_kwargs({"max_new_tokens": max_tokens, **params, "dtype": int}, "gen_int"))


def gen_string(name: str | None = None, max_tokens: int | None = None, **params: Any) -> Expr:
    """A double-quoted string, quotes included (the runtime constrains the output)."""
    params = {"max_new_tokens": max_tokens, **params, "dtype": str}
    return Gen(name, SglSamplingParams.from_kwargs(params, "gen_string"))


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized, *, lora_path: str | None = None) -> Select:
    """Pick one of `choices` by the model's likelihood of each after the text so far (with
    `lora_path`, that of a LoRA adapter the server serves)."""
    if not choices or not isinstance(choices, (list, tuple)):
        raise ValueError("select: choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select: every choice must be a non-empty string")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"select: temperature must be a number >= 0, got {temperature!r}")
    if lora_path is not None and not isinstance(lora_path, str):
        raise ValueError("select: lora_path must be an adapter's name")
    return Select(name, list(choices), float(temperature), choices_method, lora_path)


def _role(role: str, expr: ExprLike | None) -> ExprList:
    inner = [] if expr is None else _items(as_expr(expr))
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def image(x: Any) -> Image:
    """An image in the program (SGLang's `sgl.image`): a path, bytes, a PIL image or a data URL.
    Any number per program and per turn; the server must serve a vision-language model."""
    from .images import image_data_url

    return Image(image_data_url(x))


def video(path: str, num_frames: int) -> Expr:
    """SGLang's `sgl.video`: refused, no model radixlm serves takes video yet."""
    raise NotImplementedError("video: not implemented (no model radixlm serves takes video); "
                              "sample frames and add each with sgl.image")


def system(expr: ExprLike | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: ExprLike | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: ExprLike | None = None) -> ExprList:
    return _role("assistant", expr)


def tool(result: Any, *, call_id: str) -> ExprList:
    """A tool's result (text, or a value written as JSON) answering the call `call_id` (an
    "id" from a gen with tools), as the chat template renders a tool message."""
    if not isinstance(call_id, str):
        raise TypeError(f"tool: call_id must be the id of a call (a str), got {call_id!r}")
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return ExprList([RoleBegin("tool", call_id), Constant(text), RoleEnd("tool", call_id)])


def separate_reasoning(expr: Gen, model_type: str) -> Gen:
    """`expr` whose think block is split off: its variable holds the answer, and
    `<name>_reasoning_content` the reasoning (model_type: "qwen3" or "deepseek-r1")."""
    if not isinstance(expr, Gen) or expr.name is None:
        raise TypeError("separate_reasoning: wraps a named gen, as separate_reasoning(gen(\"x\"), model_type=...)")
    from .tools import reasoning_reader  # the server's think-block code, loaded only when used

    return Gen(expr.name, expr.params, reasoning_reader(expr.reader, model_type))


def reasoning_name(name: str) -> str:
    return f"{name}_reasoning_content"


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
