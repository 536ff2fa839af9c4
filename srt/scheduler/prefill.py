"""The waiting queue and prompt prefill: which waiting requests go next, their admission onto
the radix cache and the KV pool, and chunked prefill of long prompts."""

from __future__ import annotations

from collections import deque
from typing import Callable

from ...radix import RadixCache, common_prefix_len
from ..core.request import FinishReason, Req
from ..core.step import ExtendPlan
from ..server_args import SchedulerSettings
from .request_kv import RequestKV

LPM_MAX_QUEUE = 256  # sorting a longer queue by cached prefix costs more than it saves
# A waiting request sharing this many uncached tokens with one being prefilled waits a step.
IN_BATCH_PREFIX_MIN = 32


class PrefillManager:
    """Owns `waiting` (requests not yet admitted, or retracted) and `chunked` (the request whose
    prompt is part way through a chunked prefill)."""

    def __init__(self, kv: RequestKV, tree: RadixCache, settings: SchedulerSettings, adapter_slots=None):
        """settings: with the device's defaults filled in (ServerArgs.with_device_defaults)."""
        self.kv = kv
        self.tree = tree
        self.budget = min(settings.max_prefill_tokens, settings.chunked_prefill_size)
        self.max_running = settings.max_running_requests
        self.longest_prefix_first = settings.schedule_policy == "lpm"
        self.adapter_slots = adapter_slots  # LoRA device slots (srt/lora/slots.py), with --enable-lora
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request: first in line to resume."""
        self.waiting.appendleft(req)

    def abort(self, rid: str) -> Req | None:
        """Takes the request out of the queue (or its chunked prefill, releasing its KV)."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self.kv.release(req)
            return req
        return None

    def clear(self) -> list[Req]:
        """Every request here, taken out (their KV is the caller's to release)."""
        reqs = list(self.waiting) + ([self.chunked] if self.chunked else [])
        self.waiting.clear()
        self.chunked = None
        return reqs

    def plan(self, num_running: int, decode_reserve: Callable[[list[ExtendPlan]], int]) -> list[ExtendPlan]:
        """This step's prefill parts: the chunked request's next chunk, then waiting requests in
        order while the token budget, the running cap and the KV pool allow (keeping
        `decode_reserve(parts)` slots for the decoding that running and admitted requests
        will do)."""
        budget = self.budget
        parts: list[ExtendPlan] = []
        chunked, self.chunked = self.chunked, None
        for req in ([chunked] if chunked else []) + self._ordered_waiting():
            newly_admitted = req is not chunked
            if budget <= 0 or (newly_admitted and num_running + len(parts) >= self.max_running):
                break
            if newly_admitted and self._shares_uncached_prefix(req, parts):
                continue  # next step its prefix comes from the cache instead of being recomputed
            if newly_admitted and self.adapter_slots is not None and not self.adapter_slots.acquire(req):
                continue  # every slot holds another adapter that running requests use
            if newly_admitted and not self.kv.admit(req):
                self.kv.release(req)  # gives its adapter's slot back
                break
            extend_len = min(req.seq_len - req.kv_len, budget)
            # Sessions' protected prefixes give way only when nothing running would free memory.
            slots = self.kv.alloc(req, extend_len, decode_reserve(parts) if newly_admitted else 0,
                                  release_sessions=not parts and num_running == 0)
            if slots is None:
                if newly_admitted:
                    self.kv.release(req)  # still in `waiting`; it retries when memory frees up
                else:
                    self.chunked = req
                break
            if newly_admitted:
                self.waiting.remove(req)
            parts.append(_extend_part(req, extend_len, slots))
            budget -= extend_len
        return parts

    def launched(self, parts: list[ExtendPlan]) -> list[Req]:
        """Bookkeeping once the engine launched this step's prefill parts (their kv_len already
        counts the tokens): returns the requests whose prompt is now complete and that decode
        from here on."""
        to_decode = []
        for part in parts:
            req = part.req
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
                to_decode.append(req)
        return to_decode

    def _shares_uncached_prefix(self, req: Req, parts: list[ExtendPlan]) -> bool:
        """Whether a request already in this batch computes a long stretch of `req`'s prompt
        that the tree does not hold yet (e.g. a few-shot prefix sent by many requests at once)."""
        if self.tree.disable or not parts:
            return False
        cached = self.tree.cached_prefix_len(req.fill_ids[:-1], req.namespace)
        fill = req.fill_ids
        shared = max((common_prefix_len(p.req.fill_ids, fill) for p in parts if p.req.namespace == req.namespace),
                     default=0)
        return shared - cached >= IN_BATCH_PREFIX_MIN

    def _ordered_waiting(self) -> list[Req]:
        if not self.longest_prefix_first or self.tree.disable or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)
        # Longest cached prefix first, so shared prefixes are computed once and reused (with the
        # hierarchical cache, a prefix on the device before an equal one on the host).
        return sorted(self.waiting, key=lambda r: -self.tree.admission_priority(r.fill_ids[:-1], r.namespace))


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
