"""The scheduler: the scheduling policy, and the loop that drives a device engine with it.

No torch here. The policy's parts own their state: the prefill manager the waiting queue and
chunked prefill (prefill.py), the decode manager the running batch and retraction (decode.py),
RequestKV who holds which KV (request_kv.py), ConstrainedDecoding the grammars
(constraints.py). Each `step()` hands the engine one `StepPlan` (an extend batch when waiting
requests fit, prefill first, else one decode step for every running request) and commits the
engine's `StepResult`s. Requests join and leave the running batch between steps (continuous
batching).

Overlap scheduling is the shape of `step()`: a step is launched before the previous step's
tokens are committed, so the host work between steps (committing tokens, finishing requests,
sending outputs, planning the next batch) runs while the device computes. A decode step feeds
each request's newest token straight from the device; requests that will surely finish
(max_new_tokens, context length) sit it out, and one that stops on EOS or a stop string
computes one token that is dropped. A step whose successor reads its tokens on the host
(grammars, penalties, logprobs, speculative verify steps) is committed right after it is
launched (lockstep); and when the next plan needs the tokens of the step in flight (a request
is about to draft, or its KV must be made by retraction), they are committed before planning.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ...radix import RadixCache
from ...radix.tiered import TieredRadixCache
from ..core.request import FinishReason, Req
from ..core.step import PendingStep, StepEngine, StepPlan
from ..feature_settings import SESSION_TOTAL_SHARE
from ..lora.registry import SchedulerAdapters
from ..server_args import ServerArgs
from .constraints import ConstrainedDecoding
from .decode import DecodeManager
from .finish import check_finished
from .kv_memory import PageAllocator, ReqToTokenTable
from .kv_tiers import CacheTiers, host_tier_request, make_storage, refuse_unsupported_with_tiers, storage_block_tokens
from .lockstep import needs_host_tokens
from .prefill import PrefillManager
from .request_kv import RequestKV
from .sessions import Sessions

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.005


class Scheduler:
    """`Scheduler(loaded, args, engine_factory)`: the policy over the device engine that
    `engine_factory` makes for the loaded model (srt/executor/device_engine.py's DeviceEngine,
    or a fake one in tests): it has `kv_capacity(config, args) -> tokens` and is called as
    `engine_factory(loaded, args, req_to_token, num_kv_slots, eos_ids=..., grammar_backend=...)`."""

    def __init__(self, loaded, args: ServerArgs, engine_factory: Callable[..., StepEngine]):
        self.args = args = args.with_device_defaults()
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_len = args.model.context_length or self.config.context_len
        self.eos_ids = _eos_ids(self.config, self.tokenizer)
        self.allocator = PageAllocator(engine_factory.kv_capacity(self.config, args), args.cache.page_size)
        self.req_table = ReqToTokenTable(args.scheduler.max_running_requests, self.context_len + 1)
        self.constraints = ConstrainedDecoding(self.tokenizer, self.config.vocab_size, self.eos_ids,
                                               args.scheduler.grammar_compile_timeout,
                                               not args.scheduler.disable_jump_forward)
        num_slots = self.allocator.num_pages * args.cache.page_size
        tiered = args.cache.enable_hierarchical_cache
        if tiered:
            refuse_unsupported_with_tiers(args)
        extra = host_tier_request(args, self.allocator.capacity) if tiered else {}
        self.engine = engine_factory(loaded, args, self.req_table.table, num_slots, eos_ids=self.eos_ids,
                                     grammar_backend=lambda: self.constraints.cache.backend, **extra)
        self.tiers: CacheTiers | None = None
        if tiered:
            self.tree = TieredRadixCache(self.allocator.capacity, self.allocator.free, self.engine.host_kv_tokens,
                                         page_size=args.cache.page_size, write_policy=args.cache.hicache_write_policy)
            block = storage_block_tokens(args.cache.page_size)
            storage, prefetch = make_storage(args, self.engine, block)
            self.tiers = CacheTiers(self.tree, self.allocator, self.engine, storage, block, prefetch)
        else:
            self.tree = RadixCache(self.allocator.capacity, self.allocator.free, page_size=args.cache.page_size,
                                   disable=args.cache.disable_radix_cache)
        # LoRA: which adapters are loaded, and the device slots running requests pin.
        self.adapters = SchedulerAdapters(args.lora, self.engine) if args.lora.enable_lora else None
        slots = self.adapters.slots if self.adapters is not None else None
        session = args.session
        total = session.session_total_tokens
        total = int(SESSION_TOTAL_SHARE * self.allocator.capacity) if total is None else total
        self.sessions = Sessions(self.tree, session.session_ttl, min(session.session_max_tokens or total, total), total)
        self.kv = RequestKV(self.allocator, self.req_table, self.tree, args.cache.page_size, self.tiers, slots,
                            self.sessions)
        self.prefill = PrefillManager(self.kv, self.tree, args.scheduler, slots)
        self.decode = DecodeManager(self.kv, args.speculative, self.context_len, requeue=self.prefill.requeue)
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

    def bind_adapter(self, req: Req, name: str | None) -> None:
        """Gives `req` the LoRA adapter `name` (None: the base model): its digest, and a cache
        namespace of its own. ValueError for a name not loaded."""
        if name is None:
            return
        if self.adapters is None:
            raise ValueError(f"lora_path: {name!r} names an adapter, but the server runs without --enable-lora")
        self.adapters.bind(req, name)

    def load_adapter(self, name: Any, path: Any) -> dict[str, Any]:
        if self.adapters is None:
            raise ValueError("lora_name: the server runs without --enable-lora")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: Any) -> dict[str, Any]:
        if self.adapters is None:
            raise ValueError("lora_name: the server runs without --enable-lora")
        held = list(self.prefill.waiting) + self.decode.running + list(self.constraints.compiling)
        if self.prefill.chunked is not None:
            held.append(self.prefill.chunked)
        return self.adapters.unload(name, busy=[r for r in held if r.adapter_name == name])

    def add_request(self, req: Req) -> None:
        if req.session_id is not None and not self.sessions.admit(req.session_id, req.namespace):
            req.session_id = None  # another namespace's session: it runs without it
        if self.tiers is not None:  # its disk blocks are read while it waits
            self.tiers.prefetch_for(req.rid, req.fill_ids[:-1], req.namespace)
        if req.sampling_params.grammar_spec is None:
            self.prefill.add(req)
        else:  # it waits for its grammar without holding anyone back
            self.constraints.submit(req)

    def abort(self, rid: str) -> Req | None:
        """Ends a request now: its KV is released and it leaves the queues at once."""
        req = self.constraints.abort(rid) or self.prefill.abort(rid) or self.decode.abort(rid)
        if self.tiers is not None:
            self.tiers.forget(rid)
        if req is not None:
            req.finish_reason = FinishReason("abort")
        return req

    def abort_all(self, message: str) -> list[Req]:
        """Ends every request (after an internal error), releasing all their KV."""
        reqs = list(self.constraints.compiling) + self.prefill.clear() + self.decode.clear()
        reqs += [r for r in self.in_flight if r not in reqs and not r.finished]
        self.constraints.compiling.clear()
        self.in_flight = []
        self.pending = None  # its tokens are dropped with their requests
        for req in reqs:
            if not req.finished:
                req.finish_reason = FinishReason("abort", message=message)
            self.kv.release(req)
            if self.tiers is not None:
                self.tiers.forget(req.rid)
        return reqs

    def flush_cache(self, include_storage: bool = False) -> bool:
        """Drops the whole radix cache, host tier included (the disk tier only with
        `include_storage`); refused (False) while requests hold parts of it."""
        if self.has_work:
            return False
        if self.pending is not None:
            self.step()  # a step of finished requests: its tokens are dropped
        self.sessions.clear()
        self.tree.reset()
        if self.tiers is not None:
            self.tiers.flush(include_storage)
        return True

    def close(self) -> None:
        """Finishes the disk tier's queued writes (a clean shutdown keeps what was saved)."""
        if self.tiers is not None:
            self.tiers.close()

    @property
    def has_work(self) -> bool:
        # A launched step's unfinished requests are running; one of finished requests only has
        # tokens to drop (committed by the next step, or flush_cache).
        return bool(self.constraints.compiling or self.prefill.has_work or self.decode.has_work)

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Launches at most one forward and commits the previous one; returns the requests
        that produced a token, prompt logprobs or an ending since the last call."""
        self.decode.drop_finished()  # aborted since the last step
        self.sessions.expire()
        self._stepped = []
        if self.constraints.compiling:
            ready, failed = self.constraints.poll()
            self._stepped.extend(failed)
            for req in ready:
                self.prefill.add(req)
        if self.pending is not None and (self.decode.reads_newest_tokens() or self._riders_may_join()):
            self._commit(self._take_pending())  # the next plan needs those tokens on the host
        plan = self._plan()
        launched = self._launch(plan) if plan is not None else None
        if launched is None and self.pending is None and not self.decode.running and not self._stepped:
            self.constraints.wait(GRAMMAR_POLL_S)  # nothing to run, perhaps grammars to wait for
        # The previous step's tokens, read while this one runs; then this one's, unless the
        # next step can be planned without them.
        done = [self._take_pending()]
        if launched is not None and self._lockstep(plan):
            done.append(launched)
        else:
            self.pending = launched
        for step in done:
            self._commit(step)
        # Finished requests leave at once, so has_work is exact between steps (flush_cache).
        self.decode.drop_finished()
        return list(dict.fromkeys(self._stepped))

    def _plan(self) -> StepPlan | None:
        parts = self.prefill.plan(len(self.decode.running), self.decode.reserve_for)
        if not parts:
            return self.decode.plan()
        riders = self.decode.riders() if self.args.scheduler.enable_mixed_chunk else []
        needs_host = any(p.input_logprobs or (p.samples and needs_host_tokens(p.req)) for p in parts)
        return StepPlan(parts + riders, decode=False, needs_host_tokens=needs_host)

    def _lockstep(self, plan: StepPlan) -> bool:
        """Whether the step after `plan` reads its tokens on the host."""
        return not self.overlap or plan.needs_host_tokens

    def _riders_may_join(self) -> bool:
        """Whether the next step may be a prefill with running requests riding along (mixed
        chunk): riders feed their newest tokens from the host. Decode-only runs still overlap."""
        return self.args.scheduler.enable_mixed_chunk and self.prefill.has_work

    def _launch(self, plan: StepPlan) -> PendingStep:
        self.in_flight = plan.reqs
        if self.adapters is not None:  # adapters newly given a slot are copied in first
            plan.adapter_loads = self.adapters.slots.take_loads()
        if self.tiers is not None:  # demotions queued while planning read slots this step reuses
            self.tiers.flush_moves()
        launched = self.engine.launch(plan)
        self.steps_launched += 1
        if self.pending is not None:
            self.steps_overlapped += 1
        # Every part's tokens now have KV, and each sampling part has a token on the way.
        for part in plan.parts:
            part.req.kv_len = part.start + part.extend_len
            if part.samples:
                part.req.pending_tokens += 1
        if not plan.decode:
            running = set(map(id, self.decode.running))  # riders: running requests in an extend batch
            prefilled = [p for p in plan.parts if id(p.req) not in running]
            self.decode.add(self.prefill.launched(prefilled))
            self._stepped.extend(plan.reqs)  # prompt chunks report logprobs; max_new_tokens=0 ends
        return launched

    def _take_pending(self) -> PendingStep | None:
        step, self.pending = self.pending, None
        return step

    def _commit(self, step: PendingStep | None) -> None:
        """Commits a launched step (waiting for its tokens): appends each token, records
        logprobs, and finishes the requests it ends."""
        if step is None:
            return
        result = step.result()
        for index, (token_logprobs, top_logprobs) in result.input_logprobs.items():
            req = step.plan.parts[index].req
            req.logprobs.input_token.extend(token_logprobs)
            req.logprobs.input_top.extend(top_logprobs)
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
                req.logprobs.output_token.append(chosen)
                if req.logprob.top_logprobs_num > 0:
                    req.logprobs.output_top.append(top)
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
        self.decode.verified(req, len(tokens) - 1)
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
            "num_running_reqs": len(self.decode.running) + (1 if self.prefill.chunked else 0),
            "num_waiting_reqs": len(self.prefill.waiting),
            "kv": self.kv_stats(),
            "cache": self.tree.stats,
            "cache_tiers": self.tier_info(),
            "lora": self.adapters.info() if self.adapters is not None else None,
            "sessions": self.sessions.info(),
            "context_len": self.context_len,
            "max_total_tokens": self.allocator.capacity,
            "page_size": self.args.cache.page_size,
            "speculative": self.spec_stats(),
            "overlap": {"enabled": self.overlap, "steps": self.steps_launched,
                        "overlapped_steps": self.steps_overlapped},
            "encoder_cache": self.encoder_cache_info(),
        }

    def encoder_cache_info(self) -> dict[str, Any] | None:
        """A vision-language model's encoder cache counters; None for a text-only model (and for
        engines without images, such as the tests' fakes)."""
        info = getattr(self.engine, "encoder_cache_info", None)
        return info() if info is not None else None

    def tier_info(self) -> dict[str, Any]:
        """Each tier's size and traffic (the device pool's as in `kv`)."""
        kv = self.kv_stats()
        info: dict[str, Any] = {"device": {"capacity_tokens": kv["capacity"], "used_tokens": kv["capacity"] - kv["free"],
                                           "cached_tokens": kv["evictable"] + kv["protected"]}}
        if self.tiers is not None:
            info.update(self.tiers.info())
        return info

    def spec_stats(self) -> dict[str, Any]:
        """Verify steps and the tokens each produced on average (accepted drafts + 1)."""
        steps = self.spec_verify_steps
        return {"algorithm": self.args.speculative.speculative_algorithm, "verify_steps": steps,
                "accepted_tokens": self.spec_accepted_tokens,
                "mean_accepted_length": round(1 + self.spec_accepted_tokens / steps, 3) if steps else None}

    def kv_stats(self) -> dict[str, Any]:
        """KV accounting; `leaked` must be 0 when no request holds memory."""
        free = self.allocator.available_size
        evictable, protected = self.tree.evictable_size, self.tree.protected_size
        ps = self.args.cache.page_size
        holders = self.decode.running + ([self.prefill.chunked] if self.prefill.chunked else [])
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
