"""Masks a step's logits to what each constrained request's grammar allows next."""

from __future__ import annotations

from typing import Sequence

import torch

from ..constrained.backend import GrammarBackend
from ..core.request import Req


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Req], backend: GrammarBackend) -> None:
    """Sets the logits of tokens a request's grammar forbids to -inf, in place (row i is reqs[i])."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    bitmask = backend.allocate_bitmask(len(reqs))
    for row in rows:
        reqs[row].grammar.fill_bitmask(bitmask, row)
    backend.apply_bitmask(logits, bitmask, rows)


def apply_draft_grammar_masks(logits: torch.Tensor, req: Req, drafts: Sequence[int], backend: GrammarBackend) -> None:
    """Masks a verify step's rows, in place: row i by the request's grammar state after its first
    i drafts (which the grammar admits: the decode manager cut them), as plain decoding would have
    masked each of those steps. Rows after a draft that completes the grammar stay unmasked:
    the request ends at that draft."""
    matcher = req.grammar
    bitmask = backend.allocate_bitmask(len(drafts) + 1)
    rows, accepted = [], 0
    for row in range(len(drafts) + 1):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, row)
        rows.append(row)
        if row < len(drafts):
            if not matcher.accept_token(drafts[row]):
                raise RuntimeError(f"draft {drafts[row]} violates the request's grammar")
            accepted += 1
    if accepted:
        matcher.rollback(accepted)
    backend.apply_bitmask(logits, bitmask, rows)
