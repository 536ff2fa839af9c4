"""Token logprobs (the model's raw distribution) as plain values."""

from __future__ import annotations

import torch

from ..core.request import Req
from ..core.step import TokenLogprob


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = logprobs.topk(k)
    return list(zip(values.tolist(), ids.tolist()))


def output_logprobs(logprobs: torch.Tensor, tokens: list[int], top_ks: list[int | None]) -> list[TokenLogprob | None]:
    """Row i of `logprobs` (log-softmax over the vocabulary) drew `tokens[i]`: its logprob and
    its `top_ks[i]` best alternatives, or None where `top_ks[i]` is None (not asked for)."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    return [None if k is None else ((chosen[i], tokens[i]), _top(logprobs[i], k) if k > 0 else [])
            for i, k in enumerate(top_ks)]


def input_logprobs(req: Req, logits: torch.Tensor, first_pos: int) -> tuple[list[tuple[float | None, int]], list]:
    """`logits` rows are positions first_pos, first_pos+1, ...; row p scores prompt token p+1.

    Prompt tokens from logprob_start_len on are scored; token 0 has no logprob (None), nor has
    an image's placeholder (its pseudo id lies past the vocabulary). Returns (logprob, token)
    pairs and, when top_logprobs_num > 0, the top alternatives of each.
    """
    prompt = req.origin_input_ids
    start = req.logprob.logprob_start_len
    top_k = req.logprob.top_logprobs_num
    token_lps: list[tuple[float | None, int]] = []
    top_lps: list = []
    if start == 0 and first_pos == 0 and not req.logprobs.input_token:
        token_lps.append((None, prompt[0]))
        top_lps.append(None)
    rows = min(logits.shape[0], len(prompt) - 1 - first_pos)
    if rows <= 0:
        return token_lps, top_lps
    logprobs = torch.log_softmax(logits[:rows], dim=-1)
    tokens = prompt[first_pos + 1:first_pos + 1 + rows]
    vocab = logprobs.shape[1]
    targets = torch.tensor([t if t < vocab else 0 for t in tokens], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    for i, (lp, tok) in enumerate(zip(chosen, tokens)):
        if first_pos + 1 + i < start:
            continue
        token_lps.append((lp if tok < vocab else None, tok))
        if top_k > 0:
            top_lps.append(_top(logprobs[i], top_k))
    return token_lps, top_lps
