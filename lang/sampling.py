"""The language's sampling parameters (SglSamplingParams, named as in SGLang's frontend): one
type for `gen(...)`, `run(...)` and the wire.

Every field defaults to None, meaning "not set here": a gen's values override the run's, and
whatever neither sets is left to the server's own defaults. (The runtime's own
radixlm.srt.sampling_params.SamplingParams is the other side: validated values, every field
holding its default.) Keyword names are the server's (`max_new_tokens`, ...) plus SGLang
frontend aliases (`max_tokens`, `min_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# SGLang's frontend spells two fields as OpenAI does.
ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# Fields that travel in the request body beside `sampling_params`, not inside it.
_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
# Constrained generation; dtype becomes a regex.
_CONSTRAINT_FIELDS = ("dtype", "regex", "json_schema")
# The regex each dtype stands for (a bare value, as SGLang's frontend does; the value stays
# text, as there). Digit runs are bounded so a sampled number cannot run to max_tokens.
_DTYPE_REGEX = {
    "int": r"[-+]?[0-9]{1,19}",
    "float": r"[-+]?[0-9]{1,19}(\.[0-9]{1,19})?",
    "bool": r"(True|False)",
    "str": r"\"[\w\d\s]*\"",
}


@dataclass(frozen=True)
class SglSamplingParams:
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: str | tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: type | str | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    lora_path: str | None = None  # a LoRA adapter's name on the server (--enable-lora); not a sampling value

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], where: str) -> "SglSamplingParams":
        """Builds from keyword arguments; an unknown keyword is a TypeError naming it, as Python
        gives for a bad keyword (`where` is the callable's name, for the message)."""
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            if name not in _FIELD_NAMES:
                raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
            if name in values and values[name] is not None and value is not None:
                raise TypeError(f"{where}() got both {key!r} and {name!r}")
            if value is not None or name not in values:
                values[name] = _freeze(value)
        return cls(**values)

    def merged(self, override: "SglSamplingParams") -> "SglSamplingParams":
        """These values with every field that `override` sets replaced by its value."""
        changes = {f: v for f in _FIELD_NAMES if (v := getattr(override, f)) is not None}
        return dataclasses.replace(self, **changes)

    def wire_sampling(self) -> dict[str, Any]:
        """The native API's `sampling_params` object: only the fields that are set."""
        out: dict[str, Any] = {}
        for f in _FIELD_NAMES:
            value = getattr(self, f)
            if value is None or f in _LOGPROB_FIELDS or f in _CONSTRAINT_FIELDS or f == "lora_path":
                continue
            out[f] = list(value) if isinstance(value, tuple) else value
        regex = self.regex if self.regex is not None else dtype_regex(self.dtype)
        if regex is not None:
            out["regex"] = regex
        if self.json_schema is not None:  # the native API takes the schema as a JSON string
            out["json_schema"] = schema_text(self.json_schema)
        return out

    def wire_logprob(self) -> dict[str, Any]:
        """The native API's logprob options (beside `sampling_params`): only those set."""
        return {f: getattr(self, f) for f in _LOGPROB_FIELDS if getattr(self, f) is not None}


def schema_text(schema: Any) -> str:
    """A JSON schema given as JSON text, a dict, or a pydantic model class, as JSON text."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    if isinstance(schema, dict):
        return json.dumps(schema)
    raise ValueError(f"json_schema: must be a dict, JSON text or a pydantic model class, got {schema!r}")


def dtype_regex(dtype: type | str | None) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
    if name not in _DTYPE_REGEX:
        raise ValueError(f"dtype: must be one of {sorted(_DTYPE_REGEX)} (or the type), got {dtype!r}")
    return _DTYPE_REGEX[name]


def _freeze(value: Any) -> Any:
    # Lists become tuples so that a frozen SglSamplingParams stays hashable and unshared.
    return tuple(value) if isinstance(value, list) else value


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SglSamplingParams))
