"""Recording token logprobs (the model's raw distribution) on a request."""

from __future__ import annotations

import torch

from radixlm.srt.scheduler.request import Req


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = logprobs.topk(k)
    return list(zip(values.tolist(), ids.tolist()))


def record_output_logprob(req: Req, logprobs: torch.Tensor, token: int) -> None:
    """`logprobs`: log-softmax over the vocabulary at the step that produced `token`."""
    req.output_token_logprobs.append((float(logprobs[token]), token))
    if req.logprob.top_logprobs_num > 0:
        req.output_top_logprobs.append(_top(logprobs, req.logprob.top_logprobs_num))


def record_input_logprobs(req: Req, logits: torch.Tensor, first_pos: int) -> None:
    """`logits` rows are positions first_pos, first_pos+1, ...; row p scores prompt token p+1.

    Prompt tokens from logprob_start_len on are recorded; token 0 has no logprob (None).
    """
    prompt = req.origin_input_ids
    start = req.logprob.logprob_start_len
    top_k = req.logprob.top_logprobs_num
    if start == 0 and first_pos == 0 and not req.input_token_logprobs:
        req.input_token_logprobs.append((None, prompt[0]))
        req.input_top_logprobs.append(None)
    rows = min(logits.shape[0], len(prompt) - 1 - first_pos)
    if rows <= 0:
        return
    logprobs = torch.log_softmax(logits[:rows], dim=-1)
    targets = torch.tensor(prompt[first_pos + 1:first_pos + 1 + rows], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    for i, (lp, tok) in enumerate(zip(chosen, targets.tolist())):
        if first_pos + 1 + i < start:
            continue
        req.input_token_logprobs.append((lp, tok))
        if top_k > 0:
            req.input_top_logprobs.append(_top(logprobs[i], top_k))


def logprob_meta(tokenizer, with_text: bool, top_k: int, input_token: list, input_top: list,
                 output_token: list, output_top: list) -> dict:
    """meta_info logprob fields in SGLang's shape: [logprob, token_id, token_text or None]
    triples (top lists: lists of triples; None where a prompt position has none)."""
    text = (lambda t: tokenizer.decode([t])) if with_text else (lambda t: None)

    def triples(items):
        return [[lp, t, text(t)] for lp, t in items]

    meta = {"input_token_logprobs": triples(input_token), "output_token_logprobs": triples(output_token)}
    if top_k:
        meta["input_top_logprobs"] = [None if top is None else triples(top) for top in input_top]
        meta["output_top_logprobs"] = [triples(top) for top in output_top]
    return meta

