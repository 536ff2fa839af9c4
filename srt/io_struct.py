"""Messages between the processes, as frozen dataclasses encoded with msgpack (never pickle).

Paths: tokenizer manager -> scheduler (requests, aborts, control); scheduler -> detokenizer
(token ids per step; control replies pass through unchanged); detokenizer -> tokenizer manager
(text). Each message carries plain values or nested frozen dataclasses (the request's
`SamplingParams`), so msgpack round-trips it exactly; tuples come back as tuples where a field
is declared as one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens input_ids[offset:offset + length] (pseudo
    ids derived from `content_hash`, srt/multimodal/hashing.py) and the processed pixel values
    the tower reads, as raw bytes of `dtype` in `shape`. `token_grid`: (rows, cols) of its tokens
    where the model places them on a grid (Qwen2.5-VL's M-RoPE, srt/core/image_positions.py);
    None where they are a plain run of positions (LLaVA)."""

    content_hash: str
    offset: int
    length: int
    pixels: bytes
    shape: tuple[int, ...]
    dtype: str  # a numpy dtype name ("float32")
    token_grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class TokenizedGenerateReq:
    """One sample of one prompt, as the intake (srt/intake.py) validated it: the same message
    goes over ZeroMQ to the scheduler process and into the in-process Engine's scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # n == 1: the intake gave each sample its own message and seed
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    cache_salt: str | None = None  # prefixes are shared only between requests with the same salt
    lora_path: str | None = None  # the LoRA adapter's name (--enable-lora); None: the base model
    session_id: str | None = None  # the program session whose latest prefix stays cached (sessions.py)
    images: list[ImageInput] = dataclasses.field(default_factory=list)  # in prompt order


@dataclass(frozen=True)
class AbortReq:
    rid: str
    abort_all: bool = False  # every request, whatever rid says; an empty rid alone aborts nothing


@dataclass(frozen=True)
class ControlReq:
    """A request for the scheduler's state, or a change to it: kind is "flush_cache",
    "flush_cache_storage" (the disk tier too), "server_info", "load_lora_adapter" (args:
    lora_name, lora_path), "unload_lora_adapter" (args: lora_name) or "end_session" (args: session_id)."""

    kind: str
    request_id: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ControlReply:
    request_id: str
    ok: bool
    data: dict[str, Any]


@dataclass(frozen=True)
class ReqOutput:
    """What one request produced since its previous output (token ids and logprobs are deltas)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tiers: list[int] | None = None  # of cached_tokens: from device, host, disk (tiers on)
    # Detokenization settings, repeated so the detokenizer keeps no per-request setup.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_regex: list[str] = dataclasses.field(default_factory=list)
    no_stop_trim: bool = False
    # Logprobs as [logprob, token_id] pairs; top lists as lists of pairs (None where undefined).
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[Any] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[Any] | None = None
    # Speculative decoding: verify forwards so far, and the draft tokens they accepted.
    spec_verify_ct: int = 0
    spec_accepted: int = 0


@dataclass(frozen=True)
class BatchTokenOut:
    """Scheduler -> detokenizer, once per step that produced anything to send."""

    outputs: list[ReqOutput]


@dataclass(frozen=True)
class ReqTextOutput:
    """Detokenizer -> tokenizer manager: the text delta and the ids behind it."""

    rid: str
    text_delta: str
    output: ReqOutput


@dataclass(frozen=True)
class BatchTextOut:
    outputs: list[ReqTextOutput]


@dataclass(frozen=True)
class ReadySignal:
    """A child process reports that it is up (or failed to start, with the error)."""

    process: str
    ok: bool
    error: str = ""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


_MESSAGE_TYPES = {cls.__name__: cls for cls in (
    TokenizedGenerateReq, ImageInput, SamplingParams, AbortReq, ControlReq, ControlReply, ReqOutput, BatchTokenOut,
    ReqTextOutput, BatchTextOut, ReadySignal)}
# Fields holding nested messages: (message type, is a list of them).
_NESTED = {("BatchTokenOut", "outputs"): True, ("BatchTextOut", "outputs"): True,
           ("ReqTextOutput", "output"): False, ("TokenizedGenerateReq", "sampling_params"): False,
           ("TokenizedGenerateReq", "images"): True}


def _to_plain(msg: Any) -> Any:
    if dataclasses.is_dataclass(msg):
        return [type(msg).__name__] + [_to_plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
    if isinstance(msg, list):
        return [_to_plain(x) for x in msg]
    return msg


def _from_plain(data: list[Any]) -> Any:
    name, values = data[0], data[1:]
    cls = _MESSAGE_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    kwargs = {}
    for f, value in zip(dataclasses.fields(cls), values):
        is_list = _NESTED.get((name, f.name))
        if is_list is not None:
            value = [_from_plain(v) for v in value] if is_list else _from_plain(value)
        elif isinstance(value, list) and str(f.type).startswith("tuple"):
            value = tuple(value)  # msgpack has one array type; frozen records keep their tuples
        kwargs[f.name] = value
    return cls(**kwargs)


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(payload: bytes) -> Any:
    return _from_plain(msgpack.unpackb(payload, raw=False, strict_map_key=False))
