"""What a request returns, in SGLang's shape `{"text", "output_ids", "meta_info"}`: built here
for the server (from the detokenizer's text) and the in-process Engine (from a finished Req)
alike, so both answer with the same fields, logprob triples and stop trimming."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .detokenizer.incremental import IncrementalDetokenizer
from .io_struct import TokenizedGenerateReq
from .sampling_params import SamplingParams


@dataclass
class LogprobRecord:
    """A request's logprobs so far: (logprob, token_id) pairs and top lists of pairs per token
    (None for a prompt position without one)."""

    input_token: list[Any] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_token: list[Any] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)


@dataclass
class Progress:
    """Where one request stands: its text and ids so far, and how it ended (None: running)."""

    text: str
    output_ids: list[int]
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float
    logprobs: LogprobRecord
    spec_verify_ct: int = 0  # speculative verify forwards (SGLang reports it when speculating)


def final_text(tokenizer: Any, output_ids: list[int], sp: SamplingParams,
               finish_reason: dict[str, Any] | None) -> str:
    """The whole output decoded as the server's detokenizer decodes it (the same class does the
    work, and it alone trims at the stop string or stop regex match that ended it)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens,
                                   spaces_between_special_tokens=sp.spaces_between_special_tokens,
                                   stop=sp.stop, stop_regex=sp.stop_regex,
                                   no_stop_trim=sp.no_stop_trim)
    return detok.feed(output_ids) + detok.finish(finish_reason)


def result(msg: TokenizedGenerateReq, progress: Progress, tokenizer: Any, text_in_logprobs: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": msg.rid,
        "prompt_tokens": len(msg.input_ids),
        "completion_tokens": len(progress.output_ids),
        "cached_tokens": progress.cached_tokens,
        "finish_reason": progress.finish_reason,
        "e2e_latency": progress.e2e_latency,
    }
    if progress.spec_verify_ct:
        meta["spec_verify_ct"] = progress.spec_verify_ct
    if msg.return_logprob:
        meta.update(logprob_meta(tokenizer, text_in_logprobs, msg.top_logprobs_num, progress.logprobs))
    return {"text": progress.text, "output_ids": list(progress.output_ids), "meta_info": meta}


def logprob_meta(tokenizer: Any, with_text: bool, top_k: int, record: LogprobRecord) -> dict[str, Any]:
    """meta_info logprob fields in SGLang's shape: [logprob, token_id, token_text or None]
    triples (top lists: lists of triples; None where a prompt position has none)."""
    text = (lambda t: tokenizer.decode([t])) if with_text else (lambda t: None)

    def triples(items: list[Any]) -> list[list[Any]]:
        return [[lp, t, text(t)] for lp, t in items]

    meta: dict[str, Any] = {"input_token_logprobs": triples(record.input_token),
                            "output_token_logprobs": triples(record.output_token)}
    if top_k:
        meta["input_top_logprobs"] = [None if top is None else triples(top) for top in record.input_top]
        meta["output_top_logprobs"] = [triples(top) for top in record.output_top]
    return meta
