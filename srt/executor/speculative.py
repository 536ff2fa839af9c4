"""Verifying speculative drafts against the model's own distribution.

A verify step computes logits for the request's newest token and each draft after it (row i
predicts the token after draft i). Greedy requests keep the drafts that equal the argmax and
add the argmax after the last kept one, so the output is exactly the non-speculative greedy
output. Sampling requests use rejection sampling, which leaves the output distribution
unchanged: an n-gram draft is a point mass q, so draft d is accepted with probability
min(1, p(d) / q(d)) = p(d); at the first rejection the token is drawn from the residual
(p - q)+, which is p without d, renormalised; if every draft is accepted, one more token is
drawn from the last row.
"""

from __future__ import annotations

import torch

from radixlm.srt.executor.sampler import filter_probs, make_generator
from radixlm.srt.scheduler.request import Req


def verify_drafts(req: Req, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens a verify step produces: the accepted drafts, then one token of the model's.
    `logits`: [1 + len(drafts), vocab], raw (speculating requests have no penalties)."""
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
    if req.generator is None and sp.seed is not None:
        req.generator = make_generator(sp.seed, logits.device)
    gen = req.generator
    # One uniform per draft, drawn up front: a single host read for the whole step.
    uniforms = torch.rand(len(drafts), generator=gen, device=probs.device).tolist()
    draft_probs = probs[torch.arange(len(drafts), device=probs.device),
                        torch.tensor(drafts, device=probs.device)].tolist()
    out = []
    for i, (draft, u, p) in enumerate(zip(drafts, uniforms, draft_probs)):
        if u < p:
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        total = residual.sum()
        if total <= 0:  # p(draft) was 1 up to rounding: nothing else to draw
            return out + [draft]
        return out + [int(torch.multinomial(residual / total, 1, generator=gen))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=gen))]
