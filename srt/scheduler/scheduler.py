"""The scheduler: admits requests onto the radix cache and KV pool, and runs extend/decode steps.

Each `step()` runs at most one forward: an extend batch when waiting requests fit (prefill
has priority), otherwise one decode step for every running request. Requests join and leave
the running batch between steps (continuous batching).

Overlap scheduling (on by default on CUDA): a step is launched before the previous step's
sampled tokens are read back, so the host work between steps (reading tokens, finishing
requests, sending outputs, building and planning the next batch) runs while the device
computes. A decode step feeds each request's newest token straight from the device
(`last_tokens`); requests that will surely finish (max_new_tokens, context length) are left
out, and one that stops on EOS or a stop string computes one token that is dropped. Requests
whose next step depends on their newest token on the host (grammars, penalties, logprobs)
make their steps run in lockstep.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from radixlm.radix import RadixCache, common_prefix_len
from radixlm.srt.executor.batch_builder import ExtendPlan, build_decode_batch, build_extend_batch
from radixlm.srt.constrained.decoding import ConstrainedDecoding
from radixlm.srt.scheduler.finish import check_finished
from radixlm.srt.executor.logprobs import record_input_logprobs, record_output_logprob
from radixlm.srt.executor.mem_pool import PageAllocator, ReqToTokenPool
from radixlm.srt.executor.model_runner import ModelRunner, kv_slots_for
from radixlm.srt.scheduler.request import FinishReason, Req
from radixlm.srt.scheduler.request_kv import RequestKV
from radixlm.srt.executor.sampler import apply_penalties, sample
from radixlm.srt.server_args import ServerArgs
from radixlm.srt.executor.token_transfer import SampledStep, TokenTransfer

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
GRAMMAR_POLL_S = 0.005


class Scheduler:
    def __init__(self, loaded, args: ServerArgs):
        self.args = args
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_len = args.context_length or self.config.context_len
        self.eos_ids = self._eos_ids(loaded)
        device = torch.device(args.resolved_device())
        self.device = device
        self.allocator = PageAllocator(kv_slots_for(self.config, args), args.page_size)
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 1, device)
        self.runner = ModelRunner(loaded, args, self.req_pool.table, self.allocator.num_pages * args.page_size)
        self.tree = RadixCache(self.allocator.capacity, self.allocator.free, page_size=args.page_size,
                               disable=args.disable_radix_cache)
        self.kv = RequestKV(self.allocator, self.req_pool, self.tree, args.page_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a request whose prompt is being prefilled in chunks
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.in_flight: list[Req] = []  # the batch of the forward being run
        self.constraints = ConstrainedDecoding(self.tokenizer, self.config.vocab_size, self.eos_ids,
                                               args.grammar_compile_timeout, not args.disable_jump_forward)
        # Overlap gains nothing where the forward itself runs on the host (CPU).
        self.overlap = device.type == "cuda" and not args.disable_overlap_schedule
        self.sampled: SampledStep | None = None  # launched, tokens not read back yet
        self.last_tokens = torch.zeros(args.max_running_requests, dtype=torch.int64, device=device)  # per table row
        self._transfer = TokenTransfer(device)
        self._appended: list[Req] = []  # requests that got tokens or finished since step() began

    def _eos_ids(self, loaded) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(tok_eos)
        return tuple(sorted(ids))

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        if req.sampling_params.grammar_spec is None:
            self.waiting.append(req)
        else:  # it waits for its grammar without holding anyone back
            self.constraints.submit(req)

    def abort(self, rid: str) -> Req | None:
        """Ends a request now: its KV is released and it leaves the queues at once."""
        for queue in (self.waiting, self.constraints.compiling):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = FinishReason("abort")
                    return req
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid and not req.finished:
                req.finish_reason = FinishReason("abort")
                self.kv.release(req)
                self.running = [r for r in self.running if r is not req]
                if self.chunked is req:
                    self.chunked = None
                return req
        return None

    def abort_all(self, message: str) -> list[Req]:
        """Ends every request (after an internal error), releasing all their KV."""
        compiling = self.constraints.compiling
        reqs = list(self.waiting) + compiling + self.running + ([self.chunked] if self.chunked else [])
        reqs += [r for r in self.in_flight if r not in reqs and not r.finished]
        self.in_flight = []
        self.sampled = None  # its tokens are dropped with their requests
        compiling.clear()
        self.waiting.clear()
        self.running, self.chunked = [], None
        for req in reqs:
            if not req.finished:
                req.finish_reason = FinishReason("abort", message=message)
            self.kv.release(req)
        return reqs

    def flush_cache(self) -> bool:
        """Drops the whole radix cache; refused (False) while requests hold parts of it."""
        if self.sampled is not None and all(r.finished for r in self.sampled.reqs):
            self._read_sampled()  # only tokens of finished requests, to be dropped
        if self.has_work:
            return False
        self.tree.reset()
        return True

    @property
    def has_work(self) -> bool:
        # A launched step's unfinished requests are running; one of finished requests only has
        # tokens to drop (read by the next step, or flush_cache).
        return bool(self.waiting or self.constraints.compiling or self.chunked
                    or any(not r.finished for r in self.running))

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Runs one forward; returns the requests that produced a token or finished in it."""
        self.running = [r for r in self.running if not r.finished]  # aborted since the last step
        self._appended = []
        failed: list[Req] = []
        if self.constraints.compiling:
            ready, failed = self.constraints.poll()
            self.waiting.extend(ready)
        if self.sampled is not None and (self.sampled.needs_host_tokens or self.args.enable_mixed_chunk):
            self._read_sampled()  # the next step needs those tokens on the host
        stepped: list[Req] = []
        launched = None
        plans = self._plan_extend()
        if plans:
            riders = self._decode_riders() if self.args.enable_mixed_chunk else []
            stepped, launched = self._run_extend(plans, riders)
        elif self.running:
            launched = self._run_decode()
        elif self.sampled is None and not failed:  # nothing to run, perhaps grammars to wait for: don't spin
            self.constraints.wait(GRAMMAR_POLL_S)
        self._read_sampled()  # the previous step's tokens, read while this one runs
        self.sampled = launched
        if launched is not None and (not self.overlap or launched.needs_host_tokens):
            self._read_sampled()
        # Finished requests leave at once, so has_work is exact between steps (flush_cache).
        self.running = [r for r in self.running if not r.finished]
        return list(dict.fromkeys(failed + stepped + self._appended))

    # ---- extend ----------------------------------------------------------------------------

    def _plan_extend(self) -> list[ExtendPlan]:
        budget = min(self.args.max_prefill_tokens, self.args.chunked_prefill_size)
        plans: list[ExtendPlan] = []
        chunked, self.chunked = self.chunked, None
        for req in ([chunked] if chunked else []) + self._ordered_waiting():
            newly_admitted = req is not chunked
            if budget <= 0 or (newly_admitted and len(self.running) + len(plans) >= self.args.max_running_requests):
                break
            if newly_admitted and self._shares_uncached_prefix(req, plans):
                continue  # next step its prefix comes from the cache instead of being recomputed
            if newly_admitted and not self.kv.admit(req):
                break
            extend_len = min(req.seq_len - req.kv_len, budget)
            reserve = self._decode_reserve(plans) if newly_admitted else 0
            slots = self.kv.alloc(req, extend_len, reserve)
            if slots is None:
                if newly_admitted:
                    self.kv.release(req)  # still in `waiting`; it retries when memory frees up
                else:
                    self.chunked = req
                break
            if newly_admitted:
                self.waiting.remove(req)
            plans.append(self._extend_plan(req, extend_len, slots))
            budget -= extend_len
        return plans

    def _shares_uncached_prefix(self, req: Req, plans: list[ExtendPlan]) -> bool:
        """Whether a request already in this batch computes a long stretch of `req`'s prompt
        that the tree does not hold yet (e.g. a few-shot prefix sent by many requests at once)."""
        if self.tree.disable or not plans:
            return False
        cached = self.tree.cached_prefix_len(req.fill_ids[:-1], req.namespace)
        fill = req.fill_ids
        shared = max((common_prefix_len(p.req.fill_ids, fill) for p in plans if p.req.namespace == req.namespace),
                     default=0)
        return shared - cached >= IN_BATCH_PREFIX_MIN

    def _decode_reserve(self, plans: list[ExtendPlan]) -> int:
        """KV to keep free for the tokens that running (and just admitted) requests will decode."""
        reqs = self.running + [p.req for p in plans]
        remaining = sum(max(0, r.sampling_params.max_new_tokens - len(r.output_ids)) for r in reqs)
        return int(remaining * self.new_token_ratio) + len(reqs) * self.args.page_size

    def _ordered_waiting(self) -> list[Req]:
        if self.args.schedule_policy == "fcfs" or self.tree.disable:
            return list(self.waiting)
        if len(self.waiting) > LPM_MAX_QUEUE:  # sorting a huge queue costs more than it saves
            return list(self.waiting)
        # lpm: longest cached prefix first, so shared prefixes are computed once and reused.
        return sorted(self.waiting, key=lambda r: -self.tree.cached_prefix_len(r.fill_ids[:-1], r.namespace))

    def _extend_plan(self, req: Req, extend_len: int, slots: list[int]) -> ExtendPlan:
        """Keeps logits for prompt-logprob rows (first prefill only) and, when the prompt
        completes, the last row (it predicts the next token)."""
        end = req.kv_len + extend_len
        first = end
        if req.wants_input_logprobs and not req.output_ids:
            first = max(req.kv_len, req.logprob.logprob_start_len - 1)
        if end == req.seq_len:
            first = min(first, end - 1)
        return ExtendPlan(req, req.kv_len, extend_len, slots, first, max(0, end - first))

    def _decode_riders(self) -> list[ExtendPlan]:
        """Running requests' next tokens, to ride along in this step's extend batch (mixed
        chunk), so a long prefill does not stall every stream. None when KV is short: the
        next decode step makes room by eviction or retraction instead."""
        reqs = [r for r in self.running if not r.finished]
        needed = sum(self.allocator.slots_needed(r.kv_len, r.seq_len - r.kv_len) for r in reqs)
        if not reqs or needed > self.allocator.available_size:
            return []
        return self._next_token_plans(reqs)

    def _run_extend(self, plans: list[ExtendPlan], riders: list[ExtendPlan]) -> tuple[list[Req], SampledStep | None]:
        """Returns the batch's requests (prompt chunks report input logprobs) and the sampling
        of those whose prompt completed, plus the riders."""
        self.in_flight = [p.req for p in plans + riders]
        logits = self.runner.forward(build_extend_batch(plans + riders, self.device))
        done_prefill: list[tuple[Req, torch.Tensor]] = []
        offset = 0
        for plan in plans:
            req = plan.req
            rows = logits[offset:offset + plan.logit_count]
            offset += plan.logit_count
            req.kv_len = plan.start + plan.extend_len
            if req.wants_input_logprobs and not req.output_ids:
                record_input_logprobs(req, rows, plan.first_logit_pos)
            if req.kv_len < req.seq_len:
                self.kv.cache_unfinished(req)
                self.chunked = req
            elif req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length")
                self.kv.release(req)
            else:
                # Share the prompt now, not at the end: requests arriving while this one
                # decodes (other samples, other questions on the same few-shot prefix) hit it.
                self.kv.cache_unfinished(req)
                done_prefill.append((req, rows[-1]))
        for plan in riders:  # decoding requests: their next token, nothing to cache
            plan.req.kv_len = plan.req.total_len
            done_prefill.append((plan.req, logits[offset]))
            offset += 1
        out = [p.req for p in plans + riders]
        sampled = None
        if done_prefill:
            reqs = [r for r, _ in done_prefill]
            sampled = self._sample(reqs, torch.stack([row for _, row in done_prefill]))
            self.running.extend(r for r in reqs[:len(reqs) - len(riders)] if not r.finished)
        return out, sampled

    # ---- decode ----------------------------------------------------------------------------

    def _run_decode(self) -> SampledStep | None:
        # Requests whose pending token surely ends them sit this step out.
        reqs = [r for r in self.running if not self._ends_with_pending_token(r)]
        if not reqs:
            return None
        # Make room for the new tokens (one each, more after a jump-forward): evict from the
        # tree, then retract the newest requests.
        while True:
            needed = sum(self.allocator.slots_needed(r.kv_len, r.total_len - r.kv_len) for r in reqs)
            if needed > self.allocator.available_size:
                self.tree.evict(needed - self.allocator.available_size)
            if needed <= self.allocator.available_size or len(reqs) <= 1:
                break
            if self.sampled is not None:
                # Its tokens may end requests (freeing KV), and a retracted request must take
                # its pending token along.
                self._read_sampled()
                reqs = [r for r in reqs if not r.finished]
                continue
            self._retract(reqs.pop())
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
        if not reqs:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        plans = self._next_token_plans(reqs)
        if all(p.extend_len == 1 for p in plans):
            # Pending tokens are on the device only; every newest token is in last_tokens.
            from_device = any(r.pending_tokens for r in reqs)
            batch = build_decode_batch(reqs, [p.slots[0] for p in plans], self.device,
                                       self.last_tokens if from_device else None)
        else:  # jumped-forward requests feed several tokens: an extend batch, last row each
            batch = build_extend_batch(plans, self.device)
        self.in_flight = reqs
        logits = self.runner.forward(batch)
        for req in reqs:
            req.kv_len = req.total_len
        return self._sample(reqs, logits)

    def _ends_with_pending_token(self, req: Req) -> bool:
        if not req.pending_tokens:
            return False
        limit = req.sampling_params.max_new_tokens
        return len(req.output_ids) + req.pending_tokens >= limit or req.total_len >= self.context_len

    def _next_token_plans(self, reqs: list[Req]) -> list[ExtendPlan]:
        """KV slots for the tokens each running request feeds next (its last sampled one, or
        several after a jump-forward), as one-logit extend plans. The caller made room."""
        if all(r.total_len - r.kv_len == 1 for r in reqs):
            return [ExtendPlan(r, r.kv_len, 1, [slot], r.kv_len, 1) for r, slot in zip(reqs, self.kv.alloc_one_each(reqs))]
        plans = []
        for req in reqs:
            slots = self.kv.alloc(req, req.seq_len - req.kv_len)
            if slots is None:
                raise RuntimeError("the KV pool cannot hold one request; raise --max-total-tokens")
            plans.append(ExtendPlan(req, req.kv_len, len(slots), slots, req.seq_len - 1, 1))
        return plans

    def _retract(self, req: Req) -> None:
        """Sends a running request back to waiting, freeing its KV; it resumes later by
        prefilling its prompt and output so far (greedy output is unchanged)."""
        self.running.remove(req)
        self.kv.release(req, retracting=True)
        self.waiting.appendleft(req)
        logger.info("retracted %s to free KV (%d slots free)", req.rid, self.allocator.available_size)

    # ---- sampling and finishing --------------------------------------------------------------

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> SampledStep:
        """Samples every request's next token on the device and starts copying them to the host."""
        logprobs = None
        if any(r.logprob.return_logprob for r in reqs):
            logprobs = torch.log_softmax(logits, dim=-1)
        apply_penalties(logits, reqs, self.eos_ids)
        self.constraints.mask(logits, reqs)
        next_ids = sample(logits, reqs)
        if self.overlap:
            rows = torch.tensor([r.req_pool_idx for r in reqs]).to(self.device, non_blocking=True)
            self.last_tokens[rows] = next_ids
        for req in reqs:
            req.pending_tokens += 1
        return SampledStep(reqs, self._transfer.start(next_ids), logprobs,
                           any(_needs_host_tokens(r) for r in reqs))

    def _read_sampled(self) -> None:
        """Appends the launched step's tokens (waiting for them) and finishes requests they end."""
        step, self.sampled = self.sampled, None
        if step is None:
            return
        for i, (req, token) in enumerate(zip(step.reqs, step.tokens())):
            req.pending_tokens -= 1
            if req.finished:  # aborted, or ended by the token before: this one is dropped
                continue
            self._appended.append(req)
            req.output_ids.append(token)
            if req.logprob.return_logprob:
                record_output_logprob(req, step.logprobs[i], token)
            reason = None
            if req.grammar is not None:
                room = min(req.sampling_params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len)
                reason = self.constraints.advance(req, token, room)
            reason = reason or check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
            if reason is not None:
                req.finish_reason = reason
                self.kv.release(req)

    # ---- introspection ---------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_waiting_reqs": len(self.waiting),
            "kv": self.kv_stats(),
            "cache": self.tree.stats,
            "context_len": self.context_len,
            "max_total_tokens": self.allocator.capacity,
            "page_size": self.args.page_size,
        }

    def kv_stats(self) -> dict[str, Any]:
        """KV accounting; `leaked` must be 0 when no request holds memory."""
        free = self.allocator.available_size
        evictable, protected = self.tree.evictable_size, self.tree.protected_size
        ps = self.args.page_size
        holders = self.running + ([self.chunked] if self.chunked else [])
        held = sum(-(-r.kv_len // ps) * ps - r.cached_len for r in holders if r.req_pool_idx is not None)
        capacity = self.allocator.capacity
        return {"capacity": capacity, "free": free, "evictable": evictable, "protected": protected,
                "held_by_requests": held, "leaked": capacity - free - evictable - protected - held}


def _needs_host_tokens(req: Req) -> bool:
    """Whether a request's next step reads its newest token on the host: a grammar masks by it,
    penalties and min_new_tokens count it, logprobs are read from its step's logits."""
    sp = req.sampling_params
    return (req.grammar is not None or req.logprob.return_logprob or bool(sp.frequency_penalty)
            or bool(sp.presence_penalty) or sp.repetition_penalty != 1.0
            or len(req.output_ids) + req.pending_tokens < sp.min_new_tokens)
