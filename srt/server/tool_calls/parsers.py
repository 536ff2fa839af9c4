"""Tool calls out of model text, per model family's format (`--tool-call-parser`).

- `hermes` (Hermes, Qwen2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number, text around them is content;
- `llama3_json` (Llama 3.x): an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
  objects separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (or `[TOOL_CALLS]name[ARGS]{...}`);
- `json`: the whole output is one such object, or a list of them (a markdown fence allowed).

Only calls naming one of the request's tools count; anything else stays content, so a model
that writes JSON about something else does not produce a phantom call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]


class ToolParser:
    """Splits a finished output into content and calls; `starts_call(text)` says whether a
    streamed output may be (or become) a call, so a stream holds that text back."""

    name = ""

    def __init__(self, tool_names: Iterable[str]):
        self.tool_names = set(tool_names)

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where calls begin in `text` (or may begin, if it ends with a partial marker); None
        when all of it is content for sure."""
        raise NotImplementedError

    def decided(self, held: str) -> bool:
        """Whether `held` (text from call_start on) surely begins calls, so the rest of the
        output is held to the end; False while it may still turn out to be content."""
        raise NotImplementedError

    def _calls(self, objects: Iterable[Any]) -> list[ToolCall] | None:
        """ToolCalls for decoded objects, or None if any is not a call of a known tool."""
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or obj.get("name") not in self.tool_names:
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # some models double-encode the arguments
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id()))
        return calls


def _partial_marker_at_end(text: str, marker: str) -> int | None:
    """Index where a proper prefix of `marker` ends `text`, if any."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text, [])
        objects = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                objects.append(json.loads(body))
            except ValueError:
                return Parsed(text, [])
        calls = self._calls(objects)
        if not calls:
            return Parsed(text, [])
        rest = self._BLOCK.sub("", text[start:]).strip()
        content = (text[:start].rstrip() + ("\n" + rest if rest else "")).strip()
        return Parsed(content or None, calls)

    def call_start(self, text: str) -> int | None:
        found = text.find(self.OPEN)
        return found if found >= 0 else _partial_marker_at_end(text, self.OPEN)

    def decided(self, held: str) -> bool:
        return held.startswith(self.OPEN)


def _json_objects(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` consists of (whitespace and `separators` between them), or None."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class JsonParser(ToolParser):
    """The whole output is a call object or a list of them (optionally in a ```json fence)."""

    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        fenced = self._FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        values = _json_objects(body)
        if not values or len(values) != 1:
            return Parsed(text, [])
        value = values[0]
        calls = self._calls(value if isinstance(value, list) else [value])
        return Parsed(None, calls) if calls else Parsed(text, [])

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0  # undecided: whitespace so far
        return 0 if stripped[0] in "{[`" else None

    def decided(self, held: str) -> bool:
        return bool(held.strip())


class Llama3JsonParser(JsonParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.TAG)
        values = _json_objects(body, separators=";")
        calls = self._calls(values) if values else None
        return Parsed(None, calls) if calls else Parsed(text, [])

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped) or stripped.startswith(self.TAG):
            return 0
        return 0 if stripped[0] == "{" else None

    def decided(self, held: str) -> bool:
        stripped = held.strip()
        return stripped.startswith(self.TAG) or stripped.startswith("{")


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_\-.]+)\[ARGS\]")

    def parse(self, text: str) -> Parsed:
        start = text.find(self.MARKER)
        if start < 0:
            return Parsed(text, [])
        content = text[:start].strip() or None
        body = text[start + len(self.MARKER):].strip()
        values = _json_objects(body)
        if values and len(values) == 1 and isinstance(values[0], list):
            calls = self._calls(values[0])
        else:  # name[ARGS]{...} repeated
            calls = self._named_calls(body)
        return Parsed(content, calls) if calls else Parsed(text, [])

    def _named_calls(self, body: str) -> list[ToolCall] | None:
        objects, pos = [], 0
        decoder = json.JSONDecoder()
        while pos < len(body):
            head = self._NAMED.match(body, pos)
            if head is None:
                return None
            try:
                args, pos = decoder.raw_decode(body, head.end())
            except ValueError:
                return None
            objects.append({"name": head.group(1), "arguments": args})
            pos = body.find(self.MARKER, pos) + len(self.MARKER) if self.MARKER in body[pos:] else len(body)
        return self._calls(objects) if objects else None

    def call_start(self, text: str) -> int | None:
        found = text.find(self.MARKER)
        return found if found >= 0 else _partial_marker_at_end(text, self.MARKER)

    def decided(self, held: str) -> bool:
        return held.startswith(self.MARKER)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, JsonParser)}


def parser_for(name: str, tool_names: Iterable[str]) -> ToolParser:
    try:
        return PARSERS[name](tool_names)
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (one of {', '.join(PARSERS)})") from None


def default_parser_name(chat_template: str | None) -> str:
    """The format a chat template teaches its model: read from the template's own markers."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"  # also the format we teach a model whose template has no tool section


class StreamingToolParser:
    """Feeds streamed text through a parser: content is passed on as it comes, until the text
    surely begins a call; from there on it is held and parsed once the output is complete.
    Text that may begin a call (a partial marker) waits until that is decided."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.pending = ""  # the text not passed on as content (yet)
        self.holding = False

    def feed(self, delta: str) -> str:
        """Returns the content that is certainly not part of a call."""
        self.pending += delta
        if self.holding:
            return ""
        start = self.parser.call_start(self.pending)
        cut = len(self.pending) if start is None else start
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.holding = start is not None and self.parser.decided(self.pending)
        return out

    def finish(self) -> Parsed:
        """The rest of the content and the calls, once the output is complete."""
        return self.parser.parse(self.pending)
