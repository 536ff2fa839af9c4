"""What a request returns, in SGLang's shape `{"text", "output_ids", "meta_info"}`: built here
for the server and the in-process Engine alike, so both answer with the same fields, logprob
triples and stop trimming.

The server's tokenizer manager builds one result per chunk of a request, holding only what is
new since the previous chunk (the text, ids and logprob entries of the new tokens; SGLang's
incremental streaming output) beside the request's running counters; `ResultBuilder` merges
such chunks into the whole result. The Engine builds the whole result at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .detokenizer.incremental import IncrementalDetokenizer
from .io_struct import TokenizedGenerateReq
from .sampling_params import SamplingParams

# meta_info's logprob fields: lists with one entry per token, so chunks extend them.
LOGPROB_FIELDS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


@dataclass
class LogprobRecord:
    """Logprobs as (logprob, token_id) pairs and top lists of pairs per token (None for a
    prompt position without one)."""

    input_token: list[Any] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_token: list[Any] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """A request's running counters; every chunk carries them for the whole request so far."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None  # None: still running
    e2e_latency: float
    spec_verify_ct: int = 0  # speculative verify forwards (SGLang reports it when speculating)
    cached_tiers: Sequence[int] | None = None  # cached_tokens from device, host, disk (tiers on)


class TokenTexts:
    """Token id -> its text in logprob triples, decoded once per id."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._num_tokens = len(tokenizer)

    def __call__(self, token_id: int) -> str:
        if token_id >= self._num_tokens:
            return ""  # an image placeholder's pseudo id (srt/multimodal/hashing.py) is no token
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def final_text(tokenizer: Any, output_ids: list[int], sp: SamplingParams,
               finish_reason: dict[str, Any] | None) -> str:
    """The whole output decoded as the server's detokenizer decodes it (the same class does the
    work, and it alone trims at the stop string or stop regex match that ended it)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens,
                                   spaces_between_special_tokens=sp.spaces_between_special_tokens,
                                   stop=sp.stop, stop_regex=sp.stop_regex,
                                   no_stop_trim=sp.no_stop_trim)
    return detok.feed(output_ids) + detok.finish(finish_reason)


def result(msg: TokenizedGenerateReq, text: str, output_ids: list[int], progress: Progress,
           logprobs: LogprobRecord, token_text: TokenTexts | None) -> dict[str, Any]:
    """A result for `text`, `output_ids` and `logprobs` (a chunk's or the whole request's);
    `token_text` puts each token's text in the logprob triples (None: null)."""
    meta: dict[str, Any] = {
        "id": msg.rid,
        "prompt_tokens": progress.prompt_tokens,
        "completion_tokens": progress.completion_tokens,
        "cached_tokens": progress.cached_tokens,
        "finish_reason": progress.finish_reason,
        "e2e_latency": progress.e2e_latency,
    }
    if progress.cached_tiers is not None:
        meta["cached_tokens_details"] = dict(zip(("device", "host", "storage"), progress.cached_tiers))
    if progress.spec_verify_ct:
        meta["spec_verify_ct"] = progress.spec_verify_ct
    if msg.return_logprob:  # last in meta_info: ResultBuilder and the native stream rely on it
        meta.update(logprob_meta(token_text, msg.top_logprobs_num, logprobs))
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def logprob_meta(token_text: TokenTexts | None, top_k: int, record: LogprobRecord) -> dict[str, Any]:
    """meta_info logprob fields in SGLang's shape: [logprob, token_id, token_text or None]
    triples (top lists: lists of triples; None where a prompt position has none)."""
    text = token_text or (lambda t: None)

    def triples(items: list[Any]) -> list[list[Any]]:
        return [[lp, t, text(t)] for lp, t in items]

    meta: dict[str, Any] = {"input_token_logprobs": triples(record.input_token),
                            "output_token_logprobs": triples(record.output_token)}
    if top_k:
        meta["input_top_logprobs"] = [None if top is None else triples(top) for top in record.input_top]
        meta["output_top_logprobs"] = [triples(top) for top in record.output_top]
    return meta


class ResultBuilder:
    """A request's chunks (each holding what is new) merged into its whole result: what a
    request not streamed returns. Adding a chunk costs its own size, not the result's."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: dict[str, list[Any]] = {}
        self.meta: dict[str, Any] | None = None  # the latest chunk's meta_info (running counters)

    def add(self, chunk: dict[str, Any]) -> None:
        self._texts.append(chunk["text"])
        self._ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
        for name in LOGPROB_FIELDS:
            if name in meta:
                self._logprobs.setdefault(name, []).extend(meta[name])
        self.meta = meta

    @property
    def text(self) -> str:
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def result(self) -> dict[str, Any]:
        if self.meta is None:
            raise ValueError("no chunk was added")
        return {"text": self.text, "output_ids": self._ids, "meta_info": {**self.meta, **self._logprobs}}
