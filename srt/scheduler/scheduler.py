"""The scheduler: the scheduling policy, and the loop that drives a device engine with it.

No torch here. The policy owns the queues, admission onto the radix cache and the KV pages,
chunked prefill, retraction and finishing; each `step()` it hands the engine one `StepPlan`
(an extend batch when waiting requests fit, prefill first, else one decode step for every
running request) and commits the engine's `StepResult`s. Requests join and leave the running
batch between steps (continuous batching).

Overlap scheduling is the hand-off: a step is launched before the previous step's tokens are
committed, so the host work between steps (committing tokens, finishing requests, sending
outputs, planning the next batch) runs while the device computes. A decode step feeds each
request's newest token straight from the device; requests that will surely finish
(max_new_tokens, context length) sit it out, and one that stops on EOS or a stop string
computes one token that is dropped. Requests whose next step needs their newest token on the
host (grammars, penalties, logprobs) make their steps run in lockstep, and so do speculative
verify steps (drafting reads the newest tokens on the host); a decode step in which no request
drafts overlaps as usual.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

from ...radix import RadixCache
from ..constrained.decoding import ConstrainedDecoding
from ..server_args import ServerArgs
from .batch_planner import BatchPlanner
from .finish import check_finished
from .kv_memory import PageAllocator, ReqToTokenTable
from .request import FinishReason, Req
from .request_kv import RequestKV
from .step_plan import PendingStep, StepEngine

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.005


class Scheduler:
    """`Scheduler(loaded, args)`: the policy over a DeviceEngine for the loaded model.
    `engine_factory` replaces the device engine (tests drive the policy with a fake one):
    it has `kv_capacity(config, args) -> tokens` and is called as
    `engine_factory(loaded, args, req_to_token, num_kv_slots, eos_ids=..., grammar_backend=...)`."""

    def __init__(self, loaded, args: ServerArgs, engine_factory: Callable[..., StepEngine] | None = None):
        if engine_factory is None:
            from ..executor.device_engine import DeviceEngine as engine_factory
        self.args = args = args.with_device_defaults()
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_len = args.context_length or self.config.context_len
        self.eos_ids = _eos_ids(self.config, self.tokenizer)
        self.allocator = PageAllocator(engine_factory.kv_capacity(self.config, args), args.page_size)
        self.req_table = ReqToTokenTable(args.max_running_requests, self.context_len + 1)
        self.tree = RadixCache(self.allocator.capacity, self.allocator.free, page_size=args.page_size,
                               disable=args.disable_radix_cache)
        self.kv = RequestKV(self.allocator, self.req_table, self.tree, args.page_size)
        self.constraints = ConstrainedDecoding(self.tokenizer, self.config.vocab_size, self.eos_ids,
                                               args.grammar_compile_timeout, not args.disable_jump_forward)
        self.engine = engine_factory(loaded, args, self.req_table.table, self.allocator.num_pages * args.page_size,
                                     eos_ids=self.eos_ids, grammar_backend=lambda: self.constraints.cache.backend)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.planner = BatchPlanner(self, args)
        self.chunked: Req | None = None  # a request whose prompt is being prefilled in chunks
        self.pending: PendingStep | None = None  # launched, not committed yet
        self.in_flight: list[Req] = []  # the requests of the step being launched or run
        self._stepped: list[Req] = []  # requests that produced something since step() began
        self.spec_verify_steps = 0  # speculative verify parts committed, and the drafts they accepted
        self.spec_accepted_tokens = 0
        self.steps_launched = 0  # forwards, and those whose tokens were read while the next one ran
        self.steps_overlapped = 0

    @property
    def overlap(self) -> bool:
        """Whether a step is launched before the previous one is committed (the engine's call:
        it keeps the newest tokens on the device for that)."""
        return self.engine.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.engine.overlap = on

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
        self.pending = None  # its tokens are dropped with their requests
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
        if self.pending is not None and all(r.finished for r in self.pending.plan.reqs):
            self.commit_pending()  # only tokens of finished requests, to be dropped
        if self.has_work:
            return False
        self.tree.reset()
        return True

    @property
    def has_work(self) -> bool:
        # A launched step's unfinished requests are running; one of finished requests only has
        # tokens to drop (committed by the next step, or flush_cache).
        return bool(self.waiting or self.constraints.compiling or self.chunked
                    or any(not r.finished for r in self.running))

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Launches at most one forward and commits the previous one; returns the requests
        that produced a token, prompt logprobs or an ending since the last call."""
        self.running = [r for r in self.running if not r.finished]  # aborted since the last step
        self._stepped = []
        failed: list[Req] = []
        if self.constraints.compiling:
            ready, failed = self.constraints.poll()
            self.waiting.extend(ready)
        if self.pending is not None and (self.pending.plan.needs_host_tokens or self.args.enable_mixed_chunk):
            self.commit_pending()  # the next plan needs those tokens on the host
        plan = self.planner.next_plan()
        launched = None
        if plan is not None:
            self.in_flight = plan.reqs
            launched = self.engine.launch(plan)
            self.planner.launched(plan)
            self.steps_launched += 1
            if not plan.decode:
                self._stepped.extend(plan.reqs)  # prompt chunks report logprobs; max_new_tokens=0 ends
            if self.pending is not None:
                self.steps_overlapped += 1
        elif not self.running and self.pending is None and not failed:
            self.constraints.wait(GRAMMAR_POLL_S)  # nothing to run, perhaps grammars to wait for
        self.commit_pending()  # the previous step's tokens, read while this one runs
        self.pending = launched
        if launched is not None and (not self.overlap or plan.needs_host_tokens):
            self.commit_pending()
        # Finished requests leave at once, so has_work is exact between steps (flush_cache).
        self.running = [r for r in self.running if not r.finished]
        return list(dict.fromkeys(failed + self._stepped))

    def commit_pending(self) -> None:
        """Commits the launched step (waiting for its tokens): appends each token, records
        logprobs, and finishes the requests it ends."""
        step, self.pending = self.pending, None
        if step is None:
            return
        result = step.result()
        for index, (token_logprobs, top_logprobs) in result.input_logprobs.items():
            req = step.plan.parts[index].req
            req.input_token_logprobs.extend(token_logprobs)
            req.input_top_logprobs.extend(top_logprobs)
        sampling_parts = [p for p in step.plan.parts if p.samples]
        for i, (part, token) in enumerate(zip(sampling_parts, result.tokens)):
            req = part.req
            req.pending_tokens -= 1
            if req.finished:  # aborted, or ended by the token before: this one is dropped
                continue
            self._stepped.append(req)
            if i in result.spec_tokens:
                self._commit_speculated(req, part.start, result.spec_tokens[i])
                continue
            req.output_ids.append(token)
            if result.output_logprobs and result.output_logprobs[i] is not None:
                chosen, top = result.output_logprobs[i]
                req.output_token_logprobs.append(chosen)
                if req.logprob.top_logprobs_num > 0:
                    req.output_top_logprobs.append(top)
            reason = None
            if req.grammar is not None:
                room = min(req.sampling_params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len)
                reason = self.constraints.advance(req, token, room)
            reason = reason or check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
            if reason is not None:
                req.finish_reason = reason
                self.kv.release(req)

    def _commit_speculated(self, req: Req, start: int, tokens: list[int]) -> None:
        """A verify step's tokens: the accepted drafts and the model's next token, appended one
        by one as if decoded (a stop ends it there; so does a jump-forward of a constrained
        request, as plain decoding would have jumped right after that token). KV is valid through
        the last accepted draft kept; the slots of rejected drafts are freed."""
        req.spec_verify_ct += 1
        req.spec_accepted += len(tokens) - 1
        req.drafting.verified(len(tokens) - 1)
        self.spec_verify_steps += 1
        self.spec_accepted_tokens += len(tokens) - 1
        reason = None
        kept = 0
        for token in tokens:
            req.output_ids.append(token)
            kept += 1
            jumped = False
            if req.grammar is not None:
                length = len(req.output_ids)
                room = min(req.sampling_params.max_new_tokens - length, self.context_len - req.seq_len)
                reason = self.constraints.advance(req, token, room)
                jumped = len(req.output_ids) != length or req.output_ids[-1] != token
            reason = reason or check_finished(req, self.eos_ids, self.context_len, self.tokenizer)
            if reason is not None or jumped:
                break
        # The newest token (replaced by a jump-forward, if any) has no KV yet.
        req.kv_len = min(req.seq_len - 1, start + kept)
        if reason is not None:
            req.finish_reason = reason
            self.kv.release(req)
        else:
            self.kv.truncate(req)

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
            "speculative": self.spec_stats(),
            "overlap": {"enabled": self.overlap, "steps": self.steps_launched,
                        "overlapped_steps": self.steps_overlapped},
        }

    def spec_stats(self) -> dict[str, Any]:
        """Verify steps and the tokens each produced on average (accepted drafts + 1)."""
        steps = self.spec_verify_steps
        return {"algorithm": self.args.speculative_algorithm, "verify_steps": steps,
                "accepted_tokens": self.spec_accepted_tokens,
                "mean_accepted_length": round(1 + self.spec_accepted_tokens / steps, 3) if steps else None}

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


def _eos_ids(config, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return tuple(sorted(ids))
