"""The running batch: one decode step for every running request (with speculative drafts where
they pay), KV for each step's new tokens, and retraction when the pool runs short."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from ..constrained.backend import valid_draft_len
from ..core.request import Req
from ..core.step import ExtendPlan, StepPlan
from ..feature_settings import SpeculativeSettings
from .draft_pacing import DraftPacing
from .lockstep import needs_host_tokens
from .ngram import TokenHistory, propose_ngram
from .request_kv import RequestKV
from .suffix import SuffixStore

logger = logging.getLogger(__name__)

# Admission keeps room for running requests to decode `ratio * remaining tokens` more. The ratio
# starts cautious, decays while decoding goes fine, and jumps back up after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_RATIO_BUMP = 0.2


@dataclass
class _Drafting:
    """A speculating request's drafting state: whether drafting pays for it, and its tokens as
    an array for the n-gram search."""

    pacing: DraftPacing = field(default_factory=DraftPacing)
    history: TokenHistory = field(default_factory=TokenHistory)


class DecodeManager:
    """Owns `running` (requests whose prompt is prefilled) and the decode-side state: the
    admission reserve's ratio and each speculating request's drafting state. `requeue` takes a
    retracted request back to the waiting queue."""

    def __init__(self, kv: RequestKV, speculative: SpeculativeSettings, context_len: int,
                 requeue: Callable[[Req], None]):
        self.kv = kv
        self.context_len = context_len
        self.page_size = kv.page_size
        self.requeue = requeue
        self.num_drafts = speculative.drafts_per_step  # draft tokens a verify step checks
        self.drafts_by_model = speculative.speculative_algorithm == "draft"
        self.ngram_windows = (speculative.speculative_ngram_max_match_window_size,
                              speculative.speculative_ngram_min_match_window_size)
        # Suffix speculation drafts from finished requests' outputs too (suffix.py).
        self.suffix = SuffixStore(speculative.speculative_suffix_max_tokens,
                                  speculative.speculative_suffix_max_tree_depth,
                                  speculative.speculative_suffix_max_spec_factor,
                                  speculative.speculative_suffix_min_token_prob) \
            if speculative.speculative_algorithm == "suffix" else None
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._drafting: dict[Req, _Drafting] = {}

    # ---- membership ------------------------------------------------------------------------------

    def add(self, reqs: list[Req]) -> None:
        self.running.extend(reqs)

    def drop_finished(self) -> None:
        """Finished requests leave (their KV was released when they finished); with suffix
        speculation their outputs stay to draft from (aborted ones left by abort())."""
        if any(r.finished for r in self.running):
            if self.suffix is not None:
                for req in self.running:
                    if req.finished:
                        self.suffix.add(req.namespace, req.output_ids, req.origin_input_ids)
            self.running = [r for r in self.running if not r.finished]
            self._drafting = {r: d for r, d in self._drafting.items() if not r.finished}

    def abort(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid and not req.finished:
                self._leave(req)
                self.kv.release(req)
                return req
        return None

    def clear(self) -> list[Req]:
        reqs, self.running, self._drafting = self.running, [], {}
        return reqs

    def retract(self, req: Req) -> None:
        """Sends a running request back to waiting, freeing its KV; it resumes later by
        prefilling its prompt and output so far (greedy output is unchanged)."""
        self._leave(req)
        self.kv.release(req, retracting=True)
        self.requeue(req)
        logger.info("retracted %s to free KV (%d slots free)", req.rid, self.kv.allocator.available_size)

    def _leave(self, req: Req) -> None:
        self.running.remove(req)
        self._drafting.pop(req, None)

    @property
    def has_work(self) -> bool:
        return any(not r.finished for r in self.running)

    # ---- planning -----------------------------------------------------------------------------

    def reserve_for(self, admitted: list[ExtendPlan]) -> int:
        """KV to keep free for the tokens that running (and just admitted) requests will decode."""
        reqs = self.running + [p.req for p in admitted]
        # A request ends at the context length whatever its max_new_tokens: one asking for 10^9
        # tokens must not reserve the whole pool and starve the queue.
        remaining = sum(max(0, min(r.sampling_params.max_new_tokens - len(r.output_ids), self.context_len - r.seq_len))
                        for r in reqs)
        return int(remaining * self.new_token_ratio) + len(reqs) * self.page_size

    def reads_newest_tokens(self) -> bool:
        """Whether the next decode step must be planned with every request's newest token on the
        host: a request drafts in it, or its KV does not fit without retracting (a retracted
        request takes its newest token along, and finishing ones free KV first)."""
        if self.num_drafts and any(map(self._drafts_next, self.running)):
            return True
        free = self.kv.allocator.available_size
        if len(self.running) * self.page_size <= free:
            return False  # the usual case, at no cost: with a step in flight each feeds one token
        reqs = self._stepping()
        return len(reqs) > 1 and self._slots_needed(reqs) > free + self.kv.tree.evictable_size

    def riders(self) -> list[ExtendPlan]:
        """Running requests' next tokens, to ride along in a prefill step (mixed chunk), so a
        long prefill does not stall every stream. None when KV is short: the next decode step
        makes room by eviction or retraction instead."""
        reqs = [r for r in self.running if not r.finished]
        needed = sum(self.kv.allocator.slots_needed(r.kv_len, r.seq_len - r.kv_len) for r in reqs)
        if not reqs or needed > self.kv.allocator.available_size:
            return []
        return self._next_token_parts(reqs)

    def plan(self) -> StepPlan | None:
        """The decode step for every running request that does not surely end with its pending
        token, making room for its new tokens by eviction (sessions' protections included), then
        by retracting the newest requests (only with every newest token on the host: see
        reads_newest_tokens)."""
        reqs = self._stepping()
        if not reqs:
            return None
        while True:  # sessions' protected prefixes give way before running requests do
            if self.kv.make_room(self._slots_needed(reqs), release_sessions=True) or len(reqs) <= 1:
                break
            self.retract(reqs.pop())
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        parts = self._next_token_parts(reqs)
        if self.num_drafts:
            parts = [self._with_drafts(p) for p in parts]
        # Jumped-forward requests feed several tokens, speculating ones their drafts: then it is
        # an extend batch (the last row each, every row of a speculating one). A verify step is
        # committed at once (its tokens are chosen on the host, and its KV length with them); a
        # step without drafts overlaps as if speculation were off.
        verifies = any(p.verifies for p in parts)
        return StepPlan(parts, decode=all(p.extend_len == 1 for p in parts),
                        needs_host_tokens=verifies or any(needs_host_tokens(r) for r in reqs))

    def verified(self, req: Req, accepted: int) -> None:
        """A verify step of `req` was committed with `accepted` drafts kept."""
        self._drafting_of(req).pacing.verified(accepted)

    def _stepping(self) -> list[Req]:
        """Running requests that take part in the next decode step: those whose pending token
        surely ends them (max_new_tokens, the context length) sit it out."""
        return [r for r in self.running if not r.finished and not self._ends_with_pending_token(r)]

    def _slots_needed(self, reqs: list[Req]) -> int:
        """Fresh KV slots for the tokens each request feeds next (one each, more after a
        jump-forward)."""
        return sum(self.kv.allocator.slots_needed(r.kv_len, r.total_len - r.kv_len) for r in reqs)

    def _ends_with_pending_token(self, req: Req) -> bool:
        if not req.pending_tokens:
            return False
        limit = req.sampling_params.max_new_tokens
        return len(req.output_ids) + req.pending_tokens >= limit or req.total_len >= self.context_len

    def _next_token_parts(self, reqs: list[Req]) -> list[ExtendPlan]:
        """KV slots for the tokens each running request feeds next (its last sampled one, or
        several after a jump-forward), as one-logit parts. The caller made room."""
        if all(r.total_len - r.kv_len == 1 for r in reqs):
            return [ExtendPlan(r, r.kv_len, 1, [slot], r.kv_len, 1) for r, slot in zip(reqs, self.kv.alloc_one_each(reqs))]
        parts = []
        for req in reqs:
            slots = self.kv.alloc(req, req.seq_len - req.kv_len)
            if slots is None:
                raise RuntimeError("the KV pool cannot hold one request; raise --max-total-tokens")
            parts.append(ExtendPlan(req, req.kv_len, len(slots), slots, req.seq_len - 1, 1))
        return parts

    # ---- speculative drafts ------------------------------------------------------------------------

    def _drafting_of(self, req: Req) -> _Drafting:
        state = self._drafting.get(req)
        if state is None:
            state = self._drafting[req] = _Drafting()
        return state

    def _drafts_next(self, req: Req) -> bool:
        """Whether `req` is to draft in the decode step being planned: decided before its newest
        token is on the host, so that only a request about to draft makes the step wait for the
        one in flight (and every request that drafts has its tokens on the host)."""
        return (not req.finished and _may_speculate(req) and self._drafting_of(req).pacing.due
                and not self._ends_with_pending_token(req))

    def _with_drafts(self, part: ExtendPlan) -> ExtendPlan:
        """The part with drafts after its token (n-gram or suffix drafts, or room for the draft
        model's), when the request can speculate, drafting pays for it (draft_pacing.py) and free
        KV holds them. Drafting reads the newest token, so a step with drafts runs in lockstep."""
        req = part.req
        sp = req.sampling_params
        if part.extend_len != 1 or not _may_speculate(req):
            return part
        drafting = self._drafting_of(req)
        if not drafting.pacing.due:
            drafting.pacing.skipped()
            return part
        room = min(self.num_drafts, sp.max_new_tokens - len(req.output_ids) - 1, self.context_len - req.seq_len - 1)
        if room <= 0:
            return part
        if self.drafts_by_model:  # slots only: the engine's draft model drafts (and cuts them at a grammar's end)
            drafts, count = [], room
        else:
            tokens = drafting.history.sync(req.origin_input_ids, req.output_ids)
            if self.suffix is not None:
                drafts = self.suffix.propose(req.namespace, tokens, room)
            else:
                drafts = propose_ngram(tokens, room, *self.ngram_windows)
            if req.grammar is not None:  # cut at the first draft the grammar rejects
                drafts = drafts[:valid_draft_len(req.grammar, drafts)]
            if not drafts:  # nothing to copy: an ordinary decode row, and drafting pauses a while
                drafting.pacing.no_draft()
                return part
            count = len(drafts)
        slots = self.kv.alloc_more(req, count)
        if not slots:
            return part
        n = 1 + count
        return ExtendPlan(req, part.start, n, part.slots + slots, part.start, n, drafts=drafts,
                          model_drafts=count if self.drafts_by_model else 0)


def _may_speculate(req: Req) -> bool:
    """Whether drafts can be verified for `req` with outputs exactly as without them: not while
    a penalty, a logit bias, min_new_tokens or logprobs shape each token. (Grammars can: each
    verify row is masked by the grammar state after the drafts before it.)"""
    sp = req.sampling_params
    return (not req.logprob.return_logprob and not sp.frequency_penalty
            and not sp.presence_penalty and sp.repetition_penalty == 1.0 and not sp.logit_bias
            and len(req.output_ids) + req.pending_tokens >= sp.min_new_tokens)
