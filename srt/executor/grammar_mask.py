"""Masks a step's logits to what each constrained request's grammar allows next."""

from __future__ import annotations

from typing import Sequence

import torch

from radixlm.srt.constrained.backend import GrammarBackend
from radixlm.srt.scheduler.request import Req


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Req], backend: GrammarBackend) -> None:
    """Sets the logits of tokens a request's grammar forbids to -inf, in place (row i is reqs[i])."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    bitmask = backend.allocate_bitmask(len(reqs))
    for row in rows:
        reqs[row].grammar.fill_bitmask(bitmask, row)
    backend.apply_bitmask(logits, bitmask, rows)
