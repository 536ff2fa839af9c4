"""Turn a batch of logits into next tokens: penalties, logit biases, temperature,
top-k/top-p/min-p, seeds.

Logprobs are not computed here: they describe the model's own distribution (raw logits),
which the runner takes before any penalty, bias or temperature is applied.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, Sequence

import torch

from ..sampling_params import SamplingParams


class SamplingRequest(Protocol):
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    total_len: int  # the position of the token the next draw samples


class SeededStreams:
    """The random stream of each seeded request, made from its seed on first use and kept by
    the engine for as long as the policy keeps the request's record (a weak key: nothing to
    release when it finishes). A seeded request is reproducible whatever its batch.

    per_position (--enable-deterministic-inference): the stream is re-seeded before each draw
    from (seed, position of the token drawn), so a token depends on nothing but the request,
    not on how many draws came before it (a retraction, a speculative step)."""

    def __init__(self, device: torch.device | str, per_position: bool = False):
        self.device = device
        self.per_position = per_position
        self._streams: weakref.WeakKeyDictionary[Any, torch.Generator] = weakref.WeakKeyDictionary()

    def get(self, req: SamplingRequest) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        stream = self._streams.get(req)
        if stream is None:
            stream = self._streams[req] = make_generator(seed, self.device)
        if self.per_position:
            stream.manual_seed(position_seed(seed, req.total_len))
        return stream


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for one (request seed, token position) pair: two LCG multipliers, so that
    neighbouring seeds and neighbouring positions land far apart."""
    return (seed * 6364136223846793005 + (position + 1) * 1442695040888963407) % 2**64


def apply_penalties(logits: torch.Tensor, reqs: Sequence[SamplingRequest], eos_ids: Sequence[int]) -> None:
    """In place: frequency/presence (output tokens), repetition (prompt and output, HF's rule),
    logit_bias (added as given), and min_new_tokens (no EOS or stop token before it is reached)."""
    vocab = logits.shape[-1]
    for row, req in enumerate(reqs):
        sp = req.sampling_params
        if sp.frequency_penalty or sp.presence_penalty:
            if req.output_ids:
                counts = torch.bincount(torch.tensor(req.output_ids, device=logits.device), minlength=vocab)
                logits[row] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
        if sp.repetition_penalty != 1.0:
            # Image placeholders' pseudo ids lie past the vocabulary: only tokens count.
            seen = sorted(t for t in set(req.origin_input_ids) | set(req.output_ids) if t < vocab)
            seen = torch.tensor(seen, dtype=torch.int64, device=logits.device)
            scores = logits[row, seen]
            logits[row, seen] = torch.where(scores > 0, scores / sp.repetition_penalty, scores * sp.repetition_penalty)
        if sp.logit_bias:
            ids = _on_device(list(sp.logit_bias), logits.device, torch.int64)
            logits[row, ids] += _on_device(list(sp.logit_bias.values()), logits.device, logits.dtype)
        # A grammar decides for itself when the output may end.
        if len(req.output_ids) < sp.min_new_tokens and getattr(req, "grammar", None) is None:
            blocked = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))
            if blocked:
                logits[row, blocked] = float("-inf")


def sample(logits: torch.Tensor, reqs: Sequence[SamplingRequest], streams: SeededStreams) -> torch.Tensor:
    """Next token id per row of `logits` ([B, vocab], penalties already applied); seeded
    requests draw from their own stream."""
    params = [r.sampling_params for r in reqs]
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    temps = _on_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], logits.device, logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        probs = filter_probs(probs, params)
    next_ids = torch.empty(len(reqs), dtype=torch.int64, device=logits.device)
    free_rows = []
    for row, req in enumerate(reqs):
        if greedy[row]:
            next_ids[row] = logits[row].argmax()
        elif req.sampling_params.seed is not None:
            next_ids[row] = torch.multinomial(probs[row], 1, generator=streams.get(req))[0]
        else:
            free_rows.append(row)
    if free_rows:
        rows = _on_device(free_rows, logits.device, torch.int64)
        next_ids[rows] = torch.multinomial(probs[rows], 1)[:, 0]
    return next_ids


def filter_probs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zeroes tokens outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    dev = probs.device
    top_k = _on_device([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params], dev, torch.int64)
    top_p = _on_device([p.top_p for p in params], dev, probs.dtype)
    min_p = _on_device([p.min_p for p in params], dev, probs.dtype)
    ranks = torch.arange(probs.shape[-1], device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    # Keep a token while the mass before it is below top_p (the first token always stays).
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _on_device(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on the device without waiting for the device to catch up (a blocking
    copy would; overlap scheduling samples while the host is a step ahead)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
