"""Sampling parameters: one validated, frozen type shared by the Engine, the server and the wire."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .constrained.spec import GrammarSpec, check_json_schema, check_syntax

# At most one of these constrains a request's output.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices")
MAX_N = 64  # samples per prompt in one request
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, +100 all but forces it
# Seeds are signed 64-bit (OpenAI's range); sample i of n seeds with seed + i, which stays within
# what msgpack and torch's manual_seed accept (up to 2**64 - 1).
_SEED_RANGE = (-2**63, 2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None  # JSON text; a dict is serialized on the way in
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None  # the output is exactly one of these strings
    # Token id -> added to its logit before sampling (not to the logprobs, which stay the model's).
    logit_bias: dict[int, float] | None = field(default=None, hash=False)

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return GrammarSpec(name, json.dumps(list(value)) if name == "choices" else value)
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None, vocab_size: int | None = None,
                  check_grammar: bool = True) -> "SamplingParams":
        """Validates a user's dict; every error is a ValueError naming the field. Without
        `check_grammar` a constraint spec is not parsed (where requests arrive already checked)."""
        if params is not None and not isinstance(params, dict):
            raise ValueError("sampling_params: must be an object")
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in params and params[f.name] is not None:
                values[f.name] = _coerce(f.name, params[f.name])
        sp = cls(**values)
        sp.validate(vocab_size, check_grammar)
        return sp

    def validate(self, vocab_size: int | None = None, check_grammar: bool = True) -> None:
        _check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        _check(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0")
        _check(1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        _check(self.seed is None or _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1], "seed",
               "must fit a signed 64-bit integer")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _check(not bad, "stop_token_ids", f"ids {bad[:3]} are outside the vocabulary [0, {vocab_size})")
            bad = [t for t in self.logit_bias or () if not 0 <= t < vocab_size]
            _check(not bad, "logit_bias", f"token ids {bad[:3]} are outside the vocabulary [0, {vocab_size})")
        for pattern in self.stop_regex:
            import regex

            try:
                regex.compile(pattern)
            except regex.error as e:
                raise ValueError(f"sampling_params.stop_regex: invalid pattern {pattern!r}: {e}") from None
        self._validate_constraint(check_grammar)

    def _validate_constraint(self, check_grammar: bool) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        _check(len(given) <= 1, given[-1] if given else "regex",
               f"only one of {', '.join(CONSTRAINT_FIELDS)} may be given (got {', '.join(given)})")
        spec = self.grammar_spec
        if spec is None or not check_grammar:
            return
        if spec.kind == "json_schema":
            check_json_schema(json.loads(spec.value), "sampling_params.json_schema")
        check_syntax(spec, f"sampling_params.{spec.kind}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_sample(self, index: int) -> "SamplingParams":
        """Sample `index` of n as its own request: n == 1, and with a seed, seed + index, so that
        the samples differ while each one reproduces."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index)


_INT_FIELDS = {"max_new_tokens", "top_k", "min_new_tokens", "n", "seed"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


def _coerce(name: str, value: Any) -> Any:
    if name in _INT_FIELDS:
        _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
        return value
    if name in _FLOAT_FIELDS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        _check(ok, name, f"must be a number, got {value!r}")
        return float(value)
    if name in _BOOL_FIELDS:
        _check(isinstance(value, bool), name, f"must be a boolean, got {value!r}")
        return value
    if name in ("stop", "stop_regex"):
        items = [value] if isinstance(value, str) else value
        ok = isinstance(items, (list, tuple)) and all(isinstance(s, str) and s for s in items)
        _check(ok, name, "must be a non-empty string or a list of them")
        return tuple(items)
    if name in ("regex", "ebnf"):
        _check(isinstance(value, str) and value != "", name, "must be a non-empty string")
        return value
    if name == "json_schema":
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"sampling_params.json_schema: not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("sampling_params.json_schema: nested too deeply") from None
            return value
        _check(isinstance(value, (dict, bool)), name, "must be a JSON schema (an object, or its JSON text)")
        try:
            return json.dumps(value)
        except RecursionError:
            raise ValueError("sampling_params.json_schema: nested too deeply") from None
    if name == "choices":
        ok = isinstance(value, (list, tuple)) and value and all(isinstance(c, str) and c for c in value)
        _check(bool(ok), name, "must be a non-empty list of non-empty strings")
        return tuple(value)
    if name == "logit_bias":
        return _coerce_logit_bias(value)
    if name == "stop_token_ids":
        items = [value] if isinstance(value, int) else value
        ok = isinstance(items, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)
        _check(ok, name, "must be a list of integers")
        return tuple(items)
    return value


def _coerce_logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; ids as integers or as their decimal text (JSON object keys are text)."""
    _check(isinstance(value, dict), "logit_bias", "must be an object mapping token ids to numbers")
    low, high = LOGIT_BIAS_RANGE
    bias = {}
    for key, number in value.items():
        text = str(key)
        is_id = ((isinstance(key, int) and not isinstance(key, bool) and key >= 0)
                 or (isinstance(key, str) and text.isascii() and text.isdigit()))
        _check(is_id, "logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
        ok = isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number)
        _check(ok and low <= number <= high, "logit_bias",
               f"the bias of token {text} must be a number in [{low:g}, {high:g}], got {number!r}")
        bias[int(text)] = float(number)
    return bias


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{name}: {message}")
