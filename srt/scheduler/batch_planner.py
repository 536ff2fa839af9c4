"""What runs next: the scheduler's batch decisions, as step plans for the device engine.

Admission (longest cached prefix first, KV kept for running requests' decoding), chunked
prefill, mixed-chunk riders, the decode batch, and retraction when KV runs short; then, once
the engine took a plan, the bookkeeping that follows from it (KV lengths, sharing a prompt in
the radix cache, ending requests that generate nothing). No torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...radix import common_prefix_len
from ..constrained.decoding import valid_draft_len
from ..server_args import ServerArgs
from .ngram import propose_ngram
from .request import FinishReason, Req
from .step_plan import ExtendPlan, StepPlan

if TYPE_CHECKING:
    from .scheduler import Scheduler

logger = logging.getLogger(__name__)

LPM_MAX_QUEUE = 256
# A waiting request sharing this many uncached tokens with one being prefilled waits a step.
IN_BATCH_PREFIX_MIN = 32
# Admission keeps room for running requests to decode `ratio * remaining tokens` more. The ratio
# starts cautious, decays while decoding goes fine, and jumps back up after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_RATIO_BUMP = 0.2


class BatchPlanner:
    def __init__(self, sched: Scheduler, args: ServerArgs):
        self.sched = sched
        self.args = args
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # Speculative decoding: how many draft tokens a decode step verifies.
        self.num_drafts = args.speculative_drafts_per_step

    def next_plan(self) -> StepPlan | None:
        parts = self._plan_extend()
        if parts:
            riders = self._decode_riders() if self.args.enable_mixed_chunk else []
            parts += riders
            needs_host = any(p.input_logprobs or (p.samples and _needs_host_tokens(p.req)) for p in parts)
            return StepPlan(parts, decode=False, needs_host_tokens=needs_host)
        if self.sched.running:
            return self._plan_decode()
        return None

    def launched(self, plan: StepPlan) -> None:
        """Bookkeeping once the engine launched `plan`: every part's tokens now have KV."""
        sched = self.sched
        running = set() if plan.decode else set(map(id, sched.running))
        for part in plan.parts:
            req = part.req
            req.kv_len = part.start + part.extend_len
            if part.samples:
                req.pending_tokens += 1
            if plan.decode or id(req) in running:  # decoding, or riding in this extend batch
                continue
            if req.kv_len < req.seq_len:
                sched.kv.cache_unfinished(req)
                sched.chunked = req
            elif req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length")
                sched.kv.release(req)
            else:
                # Share the prompt now, not at the end: requests arriving while this one
                # decodes (other samples, other questions on the same few-shot prefix) hit it.
                sched.kv.cache_unfinished(req)
                sched.running.append(req)

    # ---- extend ----------------------------------------------------------------------------

    def _plan_extend(self) -> list[ExtendPlan]:
        sched = self.sched
        budget = min(self.args.max_prefill_tokens, self.args.chunked_prefill_size)
        parts: list[ExtendPlan] = []
        chunked, sched.chunked = sched.chunked, None
        for req in ([chunked] if chunked else []) + self._ordered_waiting():
            newly_admitted = req is not chunked
            if budget <= 0 or (newly_admitted and len(sched.running) + len(parts) >= self.args.max_running_requests):
                break
            if newly_admitted and self._shares_uncached_prefix(req, parts):
                continue  # next step its prefix comes from the cache instead of being recomputed
            if newly_admitted and not sched.kv.admit(req):
                break
            extend_len = min(req.seq_len - req.kv_len, budget)
            reserve = self._decode_reserve(parts) if newly_admitted else 0
            slots = sched.kv.alloc(req, extend_len, reserve)
            if slots is None:
                if newly_admitted:
                    sched.kv.release(req)  # still in `waiting`; it retries when memory frees up
                else:
                    sched.chunked = req
                break
            if newly_admitted:
                sched.waiting.remove(req)
            parts.append(_extend_part(req, extend_len, slots))
            budget -= extend_len
        return parts

    def _shares_uncached_prefix(self, req: Req, parts: list[ExtendPlan]) -> bool:
        """Whether a request already in this batch computes a long stretch of `req`'s prompt
        that the tree does not hold yet (e.g. a few-shot prefix sent by many requests at once)."""
        tree = self.sched.tree
        if tree.disable or not parts:
            return False
        cached = tree.cached_prefix_len(req.fill_ids[:-1], req.namespace)
        fill = req.fill_ids
        shared = max((common_prefix_len(p.req.fill_ids, fill) for p in parts if p.req.namespace == req.namespace),
                     default=0)
        return shared - cached >= IN_BATCH_PREFIX_MIN

    def _decode_reserve(self, parts: list[ExtendPlan]) -> int:
        """KV to keep free for the tokens that running (and just admitted) requests will decode."""
        reqs = self.sched.running + [p.req for p in parts]
        # A request ends at the context length whatever its max_new_tokens: one asking for 10^9
        # tokens must not reserve the whole pool and starve the queue.
        room = self.sched.context_len
        remaining = sum(max(0, min(r.sampling_params.max_new_tokens - len(r.output_ids), room - r.seq_len))
                        for r in reqs)
        return int(remaining * self.new_token_ratio) + len(reqs) * self.args.page_size

    def _ordered_waiting(self) -> list[Req]:
        sched = self.sched
        if self.args.schedule_policy == "fcfs" or sched.tree.disable:
            return list(sched.waiting)
        if len(sched.waiting) > LPM_MAX_QUEUE:  # sorting a huge queue costs more than it saves
            return list(sched.waiting)
        # lpm: longest cached prefix first, so shared prefixes are computed once and reused.
        return sorted(sched.waiting, key=lambda r: -sched.tree.cached_prefix_len(r.fill_ids[:-1], r.namespace))

    def _decode_riders(self) -> list[ExtendPlan]:
        """Running requests' next tokens, to ride along in this step's extend batch (mixed
        chunk), so a long prefill does not stall every stream. None when KV is short: the
        next decode step makes room by eviction or retraction instead."""
        allocator = self.sched.allocator
        reqs = [r for r in self.sched.running if not r.finished]
        needed = sum(allocator.slots_needed(r.kv_len, r.seq_len - r.kv_len) for r in reqs)
        if not reqs or needed > allocator.available_size:
            return []
        return self._next_token_parts(reqs)

    # ---- decode ----------------------------------------------------------------------------

    def _plan_decode(self) -> StepPlan | None:
        sched = self.sched
        allocator = sched.allocator
        if self.num_drafts and sched.pending is not None and any(map(self._drafts_next, sched.running)):
            sched.commit_pending()  # drafting reads the newest tokens on the host
        # Requests whose pending token surely ends them sit this step out.
        reqs = [r for r in sched.running if not r.finished and not self._ends_with_pending_token(r)]
        if not reqs:
            return None
        # Make room for the new tokens (one each, more after a jump-forward): evict from the
        # tree, then retract the newest requests.
        while True:
            needed = sum(allocator.slots_needed(r.kv_len, r.total_len - r.kv_len) for r in reqs)
            if needed > allocator.available_size:
                sched.tree.evict(needed - allocator.available_size)
            if needed <= allocator.available_size or len(reqs) <= 1:
                break
            if sched.pending is not None:
                # Its tokens may end requests (freeing KV), and a retracted request must take
                # its pending token along.
                sched.commit_pending()
                reqs = [r for r in reqs if not r.finished]
                continue
            self.retract(reqs.pop())
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
        if not reqs:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        parts = self._next_token_parts(reqs)
        if self.num_drafts:
            parts = [self._with_drafts(p) for p in parts]
        # Jumped-forward requests feed several tokens, speculating ones their drafts: then it is
        # an extend batch (the last row each, every row of a speculating one). A verify step is
        # committed at once (its tokens are chosen on the host, and its KV length with them); a
        # step without drafts overlaps as if speculation were off.
        verifies = any(p.drafts or p.model_drafts for p in parts)
        return StepPlan(parts, decode=all(p.extend_len == 1 for p in parts),
                        needs_host_tokens=verifies or any(_needs_host_tokens(r) for r in reqs))

    def _drafts_next(self, req: Req) -> bool:
        """Whether `req` is to draft in the decode step being planned: decided before its newest
        token is on the host, so that only a request about to draft makes the step wait for the
        one in flight (and every request that drafts has its tokens on the host)."""
        return (not req.finished and req.drafting.due and _may_speculate(req)
                and not self._ends_with_pending_token(req))

    def _with_drafts(self, part: ExtendPlan) -> ExtendPlan:
        """The part with drafts after its token (n-gram drafts, or room for the draft model's),
        when the request can speculate, drafting pays for it (draft_pacing.py) and free KV holds
        them. Drafting reads the newest token, so a step with drafts runs in lockstep."""
        req = part.req
        sp = req.sampling_params
        if part.extend_len != 1 or not _may_speculate(req):
            return part
        if not req.drafting.due:
            req.drafting.skipped()
            return part
        room = min(self.num_drafts, sp.max_new_tokens - len(req.output_ids) - 1,
                   self.sched.context_len - req.seq_len - 1)
        if room <= 0:
            return part
        by_model = self.args.speculative_algorithm == "draft"
        if by_model:  # slots only: the engine's draft model drafts (and cuts them at a grammar's end)
            drafts, count = [], room
        else:
            tokens = req.draft_history.sync(req.origin_input_ids, req.output_ids)
            drafts = propose_ngram(tokens, room, self.args.speculative_ngram_max_match_window_size,
                                   self.args.speculative_ngram_min_match_window_size)
            if req.grammar is not None:  # cut at the first draft the grammar rejects
                drafts = drafts[:valid_draft_len(req.grammar, drafts)]
            if not drafts:  # nothing to copy: an ordinary decode row, and drafting pauses a while
                req.drafting.no_draft()
                return part
            count = len(drafts)
        slots = self.sched.kv.alloc_more(req, count)
        if not slots:
            return part
        n = 1 + count
        return ExtendPlan(req, part.start, n, part.slots + slots, part.start, n, drafts=drafts,
                          model_drafts=count if by_model else 0)

    def _ends_with_pending_token(self, req: Req) -> bool:
        if not req.pending_tokens:
            return False
        limit = req.sampling_params.max_new_tokens
        return len(req.output_ids) + req.pending_tokens >= limit or req.total_len >= self.sched.context_len

    def _next_token_parts(self, reqs: list[Req]) -> list[ExtendPlan]:
        """KV slots for the tokens each running request feeds next (its last sampled one, or
        several after a jump-forward), as one-logit parts. The caller made room."""
        kv = self.sched.kv
        if all(r.total_len - r.kv_len == 1 for r in reqs):
            return [ExtendPlan(r, r.kv_len, 1, [slot], r.kv_len, 1) for r, slot in zip(reqs, kv.alloc_one_each(reqs))]
        parts = []
        for req in reqs:
            slots = kv.alloc(req, req.seq_len - req.kv_len)
            if slots is None:
                raise RuntimeError("the KV pool cannot hold one request; raise --max-total-tokens")
            parts.append(ExtendPlan(req, req.kv_len, len(slots), slots, req.seq_len - 1, 1))
        return parts

    def retract(self, req: Req) -> None:
        """Sends a running request back to waiting, freeing its KV; it resumes later by
        prefilling its prompt and output so far (greedy output is unchanged)."""
        sched = self.sched
        sched.running.remove(req)
        sched.kv.release(req, retracting=True)
        sched.waiting.appendleft(req)
        logger.info("retracted %s to free KV (%d slots free)", req.rid, sched.allocator.available_size)


def _extend_part(req: Req, extend_len: int, slots: list[int]) -> ExtendPlan:
    """Keeps logits for prompt-logprob rows (first prefill only) and, when the prompt
    completes, the last row (it predicts the next token, unless none is wanted)."""
    end = req.kv_len + extend_len
    first = end
    input_logprobs = req.wants_input_logprobs and not req.output_ids
    if input_logprobs:
        first = max(req.kv_len, req.logprob.logprob_start_len - 1)
    completes = end == req.seq_len
    if completes:
        first = min(first, end - 1)
    return ExtendPlan(req, req.kv_len, extend_len, slots, first, max(0, end - first),
                      samples=completes and req.sampling_params.max_new_tokens > 0,
                      input_logprobs=input_logprobs and end > first)


def _may_speculate(req: Req) -> bool:
    """Whether drafts can be verified for `req` with outputs exactly as without them: not while
    a penalty, a logit bias, min_new_tokens or logprobs shape each token. (Grammars can: each
    verify row is masked by the grammar state after the drafts before it.)"""
    sp = req.sampling_params
    return (not req.logprob.return_logprob and not sp.frequency_penalty
            and not sp.presence_penalty and sp.repetition_penalty == 1.0 and not sp.logit_bias
            and len(req.output_ids) + req.pending_tokens >= sp.min_new_tokens)


def _needs_host_tokens(req: Req) -> bool:
    """Whether a request's step after the one being planned reads its newest token on the host:
    a grammar masks by it, penalties and min_new_tokens count it, logprobs are read from its
    step's logits. (The planned step's token is not counted in pending_tokens yet.)"""
    sp = req.sampling_params
    return (req.grammar is not None or req.logprob.return_logprob or bool(sp.frequency_penalty)
            or bool(sp.presence_penalty) or sp.repetition_penalty != 1.0
            or len(req.output_ids) + req.pending_tokens + 1 < sp.min_new_tokens)
