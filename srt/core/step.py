"""The step interface between the scheduling policy and the device engine.

The policy decides what runs (a `StepPlan`); the engine launches it and returns a
`PendingStep` at once, before the device has finished; the policy commits the step's
`StepResult` on a later turn of the loop (overlap scheduling) or right away (lockstep).
Only plain values and the policy's `Req` records cross it: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .request import Req

# A token's logprob and its top alternatives: (logprob, token_id), [(logprob, token_id), ...].
TokenLogprob = tuple[tuple[float, int], list[tuple[float, int]]]


@dataclass
class ExtendPlan:
    """One request's part of a step: tokens [start, start + extend_len) of its fill_ids, whose
    KV goes to `slots`. Logits are kept for `logit_count` rows from absolute position
    `first_logit_pos` (prompt logprobs and/or the next token)."""

    req: Req
    start: int
    extend_len: int
    slots: list[int]
    first_logit_pos: int
    logit_count: int
    samples: bool = True  # its last kept row draws the request's next token
    input_logprobs: bool = False  # its kept rows score prompt tokens (logprob_start_len)
    # Speculative decoding: draft tokens fed after the request's newest token (their KV goes to
    # the last len(drafts) slots); every row is kept, and the engine verifies the drafts.
    drafts: list[int] = field(default_factory=list)
    # Draft-model speculation: how many drafts the engine's draft model proposes (the slots are
    # allocated, the tokens are not known yet); the engine fills `drafts` before verifying.
    model_drafts: int = 0

    @property
    def verifies(self) -> bool:
        """A speculative verify part (a constrained one may have no drafts left)."""
        return bool(self.drafts or self.model_drafts)


@dataclass
class StepPlan:
    """One forward. `decode`: every part is one token per running request, whose newest
    token may still be on the device (the engine feeds it from there)."""

    parts: list[ExtendPlan]
    decode: bool
    # Some request needs this step's tokens on the host before its next step (grammar masks,
    # penalties, min_new_tokens, logprobs, drafting): commit right after launching, no overlap.
    needs_host_tokens: bool = False
    # LoRA adapters to copy into device slots before this step: (slot, adapter digest).
    adapter_loads: list[tuple[int, str]] = field(default_factory=list)

    @property
    def reqs(self) -> list[Req]:
        return [p.req for p in self.parts]

    @property
    def sampling_reqs(self) -> list[Req]:
        """The requests drawing a token, in the order of `StepResult.tokens`."""
        return [p.req for p in self.parts if p.samples]


@dataclass
class StepResult:
    tokens: list[int]  # tokens[i] was drawn by plan.sampling_reqs[i]
    # Per sampling request, when it asked for logprobs (else None).
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Prompt logprobs per part index that asked: (logprob or None, token) and top lists.
    input_logprobs: dict[int, tuple[list[tuple[float | None, int]], list[Any]]] = field(default_factory=dict)
    # Speculative parts, by sampling index: every token the step produced (the accepted drafts,
    # then the model's own next token); tokens[i] is the first of them.
    spec_tokens: dict[int, list[int]] = field(default_factory=dict)


class PendingStep:
    """A launched step. `result()` waits for the device (once) and returns its tokens."""

    def __init__(self, plan: StepPlan, collect: Callable[[], StepResult]):
        self.plan = plan
        self._collect = collect
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._collect()
        return self._result


class StepEngine(Protocol):
    """What the policy needs of a device engine (srt/executor/device_engine.py, or a fake)."""

    # Whether launching a step before reading the previous one's tokens pays (the forward
    # runs on a device while the host plans); False where the forward runs on the host.
    overlap: bool

    def launch(self, plan: StepPlan) -> PendingStep: ...


def kv_pool_slots(capacity_tokens: int, page_size: int) -> int:
    """Slots of a KV pool holding `capacity_tokens` usable ones: whole pages, plus page 0 (the
    padding target). Every tensor-parallel rank sizes its pool by this, as rank 0's policy does."""
    return (capacity_tokens // page_size + 1) * page_size
