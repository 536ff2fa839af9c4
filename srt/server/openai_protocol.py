"""The wire format of the OpenAI-compatible API: request bodies of /v1/completions and
/v1/chat/completions as pydantic models, the error every handler answers with, and the response
pieces (choices, logprobs, usage) built from TokenizerManager results.

Models are strict: a known field with the wrong JSON type is a 400 naming it (no "0.5" -> 0.5
coercion), while unknown fields are ignored, as OpenAI clients send fields we do not use.
SGLang's sampling extras (top_k, min_p, regex, ...) are declared so that they are type-checked
too and reach the sampler by name.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import code_for


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.err_type, self.code = message, param, status, err_type, code

    def body(self) -> dict[str, Any]:
        # The same code as the native routes give for this status, unless a route names its own.
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code or code_for(self.status)}}

    @classmethod
    def from_value_error(cls, err: ValueError, renames: dict[str, str]) -> "OpenAIError":
        """An intake ValueError ("sampling_params.top_p: must be ...") with the field
        renamed to the request's own name for it ("top_p", "max_tokens", "prompt")."""
        message = str(err)
        head, sep, rest = message.partition(":")
        if not sep or not head or " " in head:
            return cls(message)
        name = head.removeprefix("sampling_params.")
        first, dot, tail = name.partition(".")  # json_schema.properties.x: rename the field only
        param = renames.get(first, first) + dot + tail
        return cls(f"{param}:{rest}", param)

    @classmethod
    def from_validation_error(cls, err: ValidationError) -> "OpenAIError":
        errors = err.errors(include_url=False)
        # A union reports one error per branch; the deepest is the one that got furthest.
        first = max(errors, key=lambda e: len(_param_path(e["loc"]) or ""))
        if first["type"] == "json_invalid":
            return cls(f"body: malformed JSON: {first.get('ctx', {}).get('error', first['msg'])}", None)
        if first["type"] == "model_type" and not first["loc"]:
            return cls("body: must be a JSON object", None)
        param = _param_path(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        return cls(f"{param}: {message}" if param else message, param)


# Union branches show up in pydantic's error locations as type names; they are not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def _param_path(loc: tuple[Any, ...]) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


# OpenAI name -> SGLang sampling_params name, for fields passed through as they are.
_SAMPLING_FIELDS = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "top_k": "top_k",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
    "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf", "logit_bias": "logit_bias",
}


class _SamplingBody(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: prefixes are shared only between requests with the same salt
    session_id: str | None = None  # ours: the program session whose latest prefix stays cached (docs/sessions.md)
    # SGLang extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None

    @field_validator("n", "stream", "echo", "logprobs", mode="after", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        """OpenAI's spec lets clients send null for these; null means the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang sampling_params (with n; the intake expands it); unset fields keep the server defaults."""
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for name, sglang_name in _SAMPLING_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                params[sglang_name] = value
        if isinstance(params.get("json_schema"), dict):
            params["json_schema"] = json.dumps(params["json_schema"])
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    # str | list[str] | list[int] | list[list[int]]; checked in `prompts()` for a clear message.
    prompt: Any = None
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(_is_int(x) for x in p):
                return [list(p)]
            if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
                return [list(x) for x in p]
        raise OpenAIError("prompt: must be a non-empty string, a list of strings, a list of token ids "
                          "or a list of lists of token ids", "prompt")

    def check_unsupported(self) -> None:
        if self.suffix:
            raise OpenAIError("suffix: not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of: only best_of == n is supported", "best_of")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ImageURL(_Body):
    url: str  # a data URL (or base64); http(s) only with --allow-remote-images
    detail: str | None = None  # accepted and ignored: the vision tower sees one resolution


class ContentPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def as_dict(self, index: int, takes_images: bool = False) -> dict[str, Any]:
        """The message as a chat template takes it (developer is a system message): its content
        a string, or with images its parts as [{"type": "text", "text": ...}, {"type": "image"}]
        (chat.py renders them). takes_images: the model is a vision-language model."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self._content(index, takes_images)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            if self.content is None:
                message["content"] = None
        return message

    def _content(self, index: int, takes_images: bool) -> str | list[dict[str, Any]]:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            if part.type == "text":
                if part.text is None:
                    raise OpenAIError(f"{where}.text: required for a text part", f"{where}.text")
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url" and takes_images:
                if part.image_url is None:
                    raise OpenAIError(f"{where}.image_url: required for an image_url part", f"{where}.image_url")
                parts.append({"type": "image"})
            elif part.type == "image_url":
                raise OpenAIError(f"{where}: this model is text-only; images need a vision-language model", where)
            else:
                raise OpenAIError(f"{where}: content of type {part.type!r} is not supported (text and image_url "
                                  "are)", where)
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts

    def image_urls(self, index: int) -> list[tuple[str, str]]:
        """(field, url) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(f"messages[{index}].content[{j}].image_url.url", part.image_url.url)
                for j, part in enumerate(self.content) if part.type == "image_url" and part.image_url is not None]


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Fields that would change the answer, refused rather than ignored (unknown ones are ignored).
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None

    def check_unsupported(self) -> None:
        if not self.messages:
            raise OpenAIError("messages: must not be empty", "messages")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise OpenAIError(f"{name}: the deprecated function-calling fields are not supported; "
                                  "pass the functions as tools (and tool_choice)", name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise OpenAIError("modalities: only [\"text\"] is supported", "modalities")
        for name in ("audio", "web_search_options"):
            if getattr(self, name) is not None:
                raise OpenAIError(f"{name}: not supported", name)
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs: needs logprobs set to true", "top_logprobs")

    def schema_from_response_format(self) -> str | None:
        """response_format as a JSON schema string for the sampler (None for plain text)."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":  # any JSON object
            return json.dumps({"type": "object", "additionalProperties": True})
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise OpenAIError("response_format.json_schema.schema: required for type json_schema",
                              "response_format.json_schema.schema")
        return json.dumps(rf.json_schema.schema_)


# ---- response pieces, built from TokenizerManager results (chunks or whole) -------------------

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else _FINISH_REASONS.get(reason.get("type"), "stop")


def choice(meta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A choice with its finish_reason and SGLang's matched_stop (the stop string or token id)."""
    matched = (meta.get("finish_reason") or {}).get("matched")
    return {**fields, "finish_reason": finish_reason_of(meta), "matched_stop": matched}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def samples_usage(prompt_lens: list[int], group_sizes: list[int], metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of n samples per prompt: prompt p has `prompt_lens[p]` tokens and
    `group_sizes[p]` samples, whose final meta_info follow each other in `metas`. A prompt
    counts once; its later samples hit the cache its first prefill filled, so its cached
    tokens are the least any of its samples had."""
    cached, i = 0, 0
    for size in group_sizes:
        cached += min(m["cached_tokens"] for m in metas[i:i + size])
        i += size
    return usage(sum(prompt_lens), sum(m["completion_tokens"] for m in metas), cached)


def logprob_entries(meta: dict[str, Any], side: str) -> list[tuple[Any, Any]]:
    """(token triple, top triples or None) per "input" or "output" token of a result."""
    tokens = meta.get(f"{side}_token_logprobs") or []
    tops = meta.get(f"{side}_top_logprobs") or [[]] * len(tokens)
    return list(zip(tokens, tops))


def completion_logprobs(names: "TokenText", entries: list[tuple[Any, Any]],
                        offset: int) -> tuple[dict[str, Any], int]:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs, text_offset) and the
    offset after them; offsets count on from `offset`, the choice's characters before these tokens."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for (lp, tid, *_), top in entries:
        token = names.get(tid)[0]
        out["tokens"].append(token)
        out["token_logprobs"].append(_finite(lp))
        out["top_logprobs"].append(None if top is None else {names.get(t)[0]: _finite(v) for v, t, *_ in top})
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def chat_logprobs(names: "TokenText", entries: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    """Chat-style logprobs content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def item(lp: Any, tid: int) -> dict[str, Any]:
        token, raw = names.get(tid)
        return {"token": token, "logprob": _finite(lp), "bytes": list(raw)}

    return [{**item(lp, tid), "top_logprobs": [item(v, t) for v, t, *_ in top or []]}
            for (lp, tid, *_), top in entries]


def _finite(lp: float | None) -> float | None:
    """JSON has no -inf; a token the sampler masked out reports a very low logprob instead."""
    return None if lp is None else (lp if math.isfinite(lp) else -9999.0)


class TokenText:
    """Token id -> (text, exact bytes), memoized. For byte-level BPE tokenizers the bytes come
    from the token's symbols, so a token holding part of a UTF-8 character keeps its exact
    bytes; its text is then shown as OpenAI does, "bytes:\\xe2\\x80"."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
        self._byte_of = _byte_level_alphabet() if probe and probe[0].startswith("\u0120") else None

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            raw = None
            if self._byte_of is not None:
                symbols = self._tokenizer.convert_ids_to_tokens(token_id)
                if symbols and all(c in self._byte_of for c in symbols):
                    raw = bytes(self._byte_of[c] for c in symbols)
            if raw is None:
                raw = self._tokenizer.decode([token_id]).encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._cache[token_id] = (text, raw)
        return found


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the code points from 256 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return {s: b for b, s in symbols.items()}
