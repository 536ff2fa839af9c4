"""Which requests make a step run in lockstep: their next step reads the newest token on the
host, so that step cannot be planned while this one's tokens are still on the device."""

from __future__ import annotations

from ..core.request import Req


def needs_host_tokens(req: Req) -> bool:
    """Whether a request's step after the one being planned reads its newest token on the host:
    a grammar masks by it, penalties and min_new_tokens count it, logprobs are read from its
    step's logits. (The planned step's token is not counted in pending_tokens yet.)"""
    sp = req.sampling_params
    return (req.grammar is not None or req.logprob.return_logprob or bool(sp.frequency_penalty)
            or bool(sp.presence_penalty) or sp.repetition_penalty != 1.0
            or len(req.output_ids) + req.pending_tokens + 1 < sp.min_new_tokens)
