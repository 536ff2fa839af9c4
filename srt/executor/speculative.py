"""Verifying speculative drafts against the model's own distribution.

A verify step computes logits for the request's newest token and each draft after it (row i
predicts the token after draft i). Greedy requests keep the drafts that equal the argmax and
add the argmax after the last kept one, so the output is exactly the non-speculative greedy
output. Sampling requests use rejection sampling, which leaves the output distribution
unchanged: draft d, drawn from the drafter's distribution q, is accepted with probability
min(1, p(d) / q(d)); at the first rejection the token is drawn from the residual (p - q)+,
renormalised; if every draft is accepted, one more token is drawn from the last row. An n-gram
draft is a point mass (q(d) = 1): accepted with probability p(d), the residual is p without d.
"""

from __future__ import annotations

import torch

from ..core.request import Req
from .sampler import filter_probs


def verify_drafts(req: Req, logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None = None,
                  gen: torch.Generator | None = None) -> list[int]:
    """The tokens a verify step produces: the accepted drafts, then one token of the model's.
    `logits`: [1 + len(drafts), vocab], raw (speculating requests have no penalties).
    `draft_probs`: [len(drafts), vocab], the distributions the drafts were drawn from (a draft
    model's, at the request's sampling parameters); None: each draft is a point mass (n-gram).
    `gen`: a seeded request's random stream."""
    sp = req.sampling_params
    if sp.is_greedy:
        target = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == target[kept]:
            kept += 1
        return drafts[:kept] + [target[kept]]
    probs = torch.softmax(logits.float() / sp.temperature, dim=-1)
    if sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0:
        probs = filter_probs(probs, [sp] * probs.shape[0])
        probs = probs / probs.sum(dim=-1, keepdim=True)  # p(d) is the filtered distribution's
    # One uniform per draft, drawn up front: a single host read for the whole step.
    uniforms = torch.rand(len(drafts), generator=gen, device=probs.device).tolist()
    rows = torch.arange(len(drafts), device=probs.device)
    ids = torch.tensor(drafts, device=probs.device)
    p_draft = probs[rows, ids].tolist()
    q_draft = [1.0] * len(drafts) if draft_probs is None else draft_probs[rows, ids].tolist()
    out = []
    for i, (draft, u, p, q) in enumerate(zip(drafts, uniforms, p_draft, q_draft)):
        if u * q < p:  # u < p / q
            out.append(draft)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[draft] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
        total = residual.sum()
        if total <= 0:  # p and q agree up to rounding: the draft stands
            return out + [draft]
        return out + [int(torch.multinomial(residual / total, 1, generator=gen))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=gen))]
