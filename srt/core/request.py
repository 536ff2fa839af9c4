"""A request as the scheduling policy tracks it: its tokens, KV ownership, sampling parameters,
grammar matcher and results. The device engine reads it through the step plan and never writes
to it; what the engine keeps per request (RNG streams) it keeps itself. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..io_struct import ImageInput, TokenizedGenerateReq
from ..sampling_params import SamplingParams
from .image_positions import rope_delta


_PIXEL_BYTES = {"float32": 4, "float16": 2}  # pixel value dtypes an image may travel in


@dataclass(frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message:
            d["message"] = self.message
        return d


@dataclass
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: only the output tokens
    top_logprobs_num: int = 0


@dataclass
class LogprobResults:
    """Logprobs computed so far: (logprob, token_id) per token and its top-k list of pairs
    (None for a prompt position without one)."""

    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    namespace: Any = None  # radix-cache namespace: the cache salt, and the LoRA adapter's digest
    adapter_name: str | None = None  # the LoRA adapter it runs with (--enable-lora); None: the base model
    adapter_uid: str | None = None  # that adapter's digest (srt/lora/slots.py)
    adapter_slot: int | None = None  # the device slot holding it, while the request is admitted
    stream: bool = False  # send outputs every step, not only at the end
    session_id: str | None = None  # its program session (srt/scheduler/sessions.py)
    # Its images, in prompt order: the engine encodes the ones a prefill chunk overlaps.
    images: list[ImageInput] = field(default_factory=list)
    # Rotary position minus index of the tokens after the prompt (M-RoPE images take fewer
    # positions than tokens, image_positions.py); 0 without gridded images.
    rope_delta: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    grammar: Any = None  # the GrammarMatcher, once the request's grammar compiled
    # Tokens sampled on the device but not yet in output_ids: with overlap scheduling a step's
    # tokens reach the host while the next step runs (at most one between steps).
    pending_tokens: int = 0

    # KV ownership. Slots of tokens [0, kv_len) are in the req-to-token row; of those,
    # [0, cached_len) belong to the radix tree (locked through `last_node`).
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    alloc_len: int = 0  # table positions with slots allocated (>= kv_len while a forward runs)
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the cache, for meta_info
    cached_tiers: tuple[int, int, int] | None = None  # of those: from device, host, disk (tiers on)
    # Speculative decoding: verify forwards run for this request, and draft tokens accepted.
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    logprobs: LogprobResults = field(default_factory=LogprobResults)

    @classmethod
    def from_tokenized(cls, msg: TokenizedGenerateReq, vocab_size: int) -> Req:
        """The record of a request the intake validated. Raises ValueError for a message whose
        sampling parameters do not validate (a bad peer)."""
        sp = msg.sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(sp).__name__}")
        try:
            # Cheap range checks only: the intake parsed any grammar already, and parsing it
            # again here would stall the loop.
            sp.validate(vocab_size=vocab_size, check_grammar=False)
        except TypeError as e:  # a field of the wrong type from a bad peer
            raise ValueError(f"sampling_params: {e}") from None
        _check_images(msg.input_ids, msg.images, vocab_size)
        return cls(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=sp,
                   logprob=LogprobOptions(msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num),
                   namespace=msg.cache_salt, stream=msg.stream, session_id=msg.session_id, images=list(msg.images),
                   rope_delta=rope_delta(msg.images))

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def total_len(self) -> int:
        """seq_len with the pending token: the position after the one the next step feeds."""
        return self.seq_len + self.pending_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob.return_logprob and 0 <= self.logprob.logprob_start_len < len(self.origin_input_ids)


def _check_images(ids: list[int], images: list[ImageInput], vocab_size: int) -> None:
    """Every id past the vocabulary is an image's placeholder, and every image has its pixels:
    a token without its image would put made-up KV into the radix cache under the image's key."""
    covered = 0
    for i, image in enumerate(images):
        span = ids[image.offset:image.offset + image.length]
        if image.offset < 0 or len(span) != image.length or any(t < vocab_size for t in span):
            raise ValueError(f"images[{i}]: tokens [{image.offset}, {image.offset + image.length}) are not its "
                             "placeholders")
        if image.dtype not in _PIXEL_BYTES or len(image.pixels) != math.prod(image.shape) * _PIXEL_BYTES[image.dtype]:
            raise ValueError(f"images[{i}]: {len(image.pixels)} bytes are not {image.dtype} pixels of shape {image.shape}")
        grid = image.token_grid
        if grid is not None and (len(grid) != 2 or min(grid) < 1 or grid[0] * grid[1] != image.length):
            raise ValueError(f"images[{i}]: token_grid {grid} does not hold its {image.length} tokens")
        covered += image.length
    if sum(1 for t in ids if t >= vocab_size) != covered:
        raise ValueError("input_ids: token ids past the vocabulary outside any image")
