"""The device engine: runs the scheduler's step plans on the model.

`launch(plan)` builds the batch, runs the forward (a CUDA graph where one fits), applies
penalties and grammar masks, samples, and starts copying the tokens to the host; it returns
a PendingStep at once. The tokens (and logprobs) are read when the scheduler commits it. With
overlap scheduling each request's newest token also stays on the device (`last_tokens`, per
table row), so the next decode step can be launched before this one's tokens reach the host.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..constrained.backend import GrammarBackend
from ..core.request import Req
from ..core.step import PendingStep, StepPlan, StepResult
from ..server_args import ServerArgs
from .batch_builder import (build_decode_batch, build_extend_batch, build_verify_batch,
                            keeps_every_row)
from .host_kv import HostKVPool, agree_on_host_tokens, host_tier_tokens, model_identity
from .grammar_mask import apply_draft_grammar_masks, apply_grammar_masks
from .logprobs import input_logprobs, output_logprobs
from .model_runner import ModelRunner, kv_slots_for
from .parallel import TensorParallel
from .sampler import SeededStreams, apply_penalties, sample
from .speculative import verify_drafts
from .token_transfer import TokenTransfer


# A verify step runs as a decode batch of one row per token (CUDA graphs) up to this many rows,
# beyond as one extend forward. H200, Llama-3.1-8B shape, 512 tokens of context: decode rows cost
# 1.01-1.05x a decode step at batch 1 (an extend 2.4x), but 13.9 against 12.4 ms at 64 x 5 rows
# (each row reads its request's whole KV).
VERIFY_AS_DECODE_MAX_ROWS = 256


def kv_capacity(config, args: ServerArgs, tp: TensorParallel = TensorParallel()) -> int:
    """Token slots the KV pool can hold (--max-total-tokens, or what the device has room for;
    with a draft model, each slot holds both models' K/V)."""
    if args.speculative.speculative_algorithm == "draft":
        from .draft_model import kv_slots_with_draft

        return kv_slots_with_draft(config, args, tp)
    return kv_slots_for(config, args, tp)


class DeviceEngine:
    def __init__(self, loaded, args: ServerArgs, req_to_token: np.ndarray, num_kv_slots: int, *,
                 eos_ids: Sequence[int], grammar_backend: Callable[[], GrammarBackend],
                 tp: TensorParallel = TensorParallel(), host_kv_tokens: int | None = None,
                 host_kv_bytes: int | None = None):
        """req_to_token: the scheduler's host table, read in place (a tensor view of it).
        tp: this rank's tensor-parallel group (the model's shard in `loaded` is its own).
        host_kv_tokens / host_kv_bytes: the hierarchical cache's host tier (host_kv.py)."""
        self.device = torch.device(args.model.resolved_device())
        self.runner = ModelRunner(loaded, args, torch.from_numpy(req_to_token), num_kv_slots, tp)
        self.host_kv: HostKVPool | None = None
        if host_kv_tokens is not None or host_kv_bytes is not None:
            pool = self.runner.kv_pool
            bpt = HostKVPool.token_bytes(pool)
            tokens = agree_on_host_tokens(host_tier_tokens(bpt, host_kv_tokens, host_kv_bytes), tp)
            self.host_kv = HostKVPool(pool, tokens, self.device)
            self.host_kv_tokens = tokens
            self.kv_bytes_per_token = bpt
            self.kv_identity = model_identity(loaded, args, tp.rank, pool.dtype)
        self.draft = None  # draft-model speculation: its own KV pool, the same slots
        if args.speculative.speculative_algorithm == "draft":
            from .draft_model import DraftModel

            self.draft = DraftModel(loaded, args, torch.from_numpy(req_to_token), num_kv_slots)
        self.eos_ids = tuple(eos_ids)
        self._grammar_backend = grammar_backend
        # Overlap gains nothing where the forward itself runs on the host (CPU).
        self.overlap = self.device.type == "cuda" and not args.scheduler.disable_overlap_schedule
        self.last_tokens = torch.zeros(args.scheduler.max_running_requests, dtype=torch.int64, device=self.device)
        self._transfer = TokenTransfer(self.device)
        # LoRA: the runner's handle and files of each adapter loaded (by digest), and the
        # handles dropped since the last forward (the other tensor-parallel ranks drop them then).
        self._adapters: dict[str, tuple[int, str]] = {}
        self._adapter_drops: list[int] = []
        self._next_handle = 0
        # Per-request device state: seeded random streams.
        self._streams = SeededStreams(self.device, per_position=args.executor.enable_deterministic_inference)

    # ---- the hierarchical cache's copies (scheduler/kv_tiers.py asks for them) ----------------

    @torch.inference_mode()
    def move_kv(self, moves) -> None:
        if self.runner.step_sender is not None:  # the other ranks move their shards too
            self.runner.step_sender.send_moves(moves)
        self.host_kv.run(moves)

    @torch.inference_mode()
    def read_kv_tokens(self, slots: list[int]) -> memoryview:
        return self.host_kv.read_tokens(slots)

    def kv_staging(self, nbytes: int) -> memoryview:
        return self.host_kv.staging(nbytes)

    def kv_prefetch_buffer(self, nbytes: int):
        """Reserves `nbytes` of host memory for disk blocks read ahead of their request; returns
        a function that hands it out as a memoryview (host_kv.reserve_prefetch)."""
        self.host_kv.reserve_prefetch(nbytes)
        return self.host_kv.prefetch_buffer

    @torch.inference_mode()
    def upload_kv_tokens(self, slots: list[int], offset: int, source: memoryview | None = None) -> None:
        self.host_kv.upload_tokens(slots, offset, source)

    def defer_host_pinning(self, seconds: float) -> None:
        """A load from the host or disk tier is under way: the host tier's background pinning
        waits `seconds` (host_segments.PinningGate)."""
        self.host_kv.pinning_gate.defer(seconds)

    def wait_kv_uploads(self) -> None:
        self.host_kv.wait_uploads()

    def close_host_kv(self) -> None:
        self.host_kv.close()

    def host_kv_stats(self) -> dict:
        return {**self.host_kv.timings(), "allocated_bytes": self.host_kv.allocated_bytes}

    def encoder_cache_info(self) -> dict | None:
        """The vision encoder cache's counters (srt/multimodal/encoder_cache.py); None for a
        text-only model."""
        images = self.runner.images
        return images.cache.stats() if images is not None else None

    # ---- LoRA adapters (srt/lora/registry.py asks for them) ---------------------------------

    def load_adapter(self, uid: str, path: str, config) -> None:
        """Reads an adapter's tensors into host memory (ValueError naming what does not fit);
        the other tensor-parallel ranks read their parts when a step first loads it."""
        handle = self._next_handle
        self.runner.lora.add(handle, path, config)
        self._next_handle += 1
        self._adapters[uid] = (handle, path)

    def drop_adapter(self, uid: str) -> None:
        handle, _ = self._adapters.pop(uid)
        self.runner.lora.drop(handle)
        self._adapter_drops.append(handle)

    def _add_adapters(self, plan: StepPlan, batch) -> None:
        """The batch's LoRA columns: every batch builder feeds each part's extend_len tokens in
        part order."""
        batch.adapter_loads = tuple((slot, *self._adapters[uid]) for slot, uid in plan.adapter_loads)
        batch.adapter_drops, self._adapter_drops = tuple(self._adapter_drops), []
        if any(p.req.adapter_slot is not None for p in plan.parts):
            batch.adapter_slots = [-1 if p.req.adapter_slot is None else p.req.adapter_slot
                                   for p in plan.parts for _ in range(p.extend_len)]

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        draft_probs: dict[int, torch.Tensor] = {}  # by part index: the draft model's q
        speculating = self.draft is not None and any(p.model_drafts for p in plan.parts)
        if speculating:  # the draft model fills in the drafts (and its KV for the whole step)
            plan, draft_probs = self.draft.propose(plan, self._grammar_backend, self._streams)
        if plan.decode:
            from_device = any(p.req.pending_tokens for p in plan.parts)
            batch = build_decode_batch(plan.parts, self.device, self.last_tokens if from_device else None)
        elif (any(p.verifies for p in plan.parts) and keeps_every_row(plan.parts)
              and sum(p.extend_len for p in plan.parts) <= VERIFY_AS_DECODE_MAX_ROWS):
            batch = build_verify_batch(plan.parts, self.device)
        else:
            batch = build_extend_batch(plan.parts, self.device)
        if self.draft is not None and not speculating:
            self.draft.follow(batch)  # the draft's KV for the same tokens
        if self.runner.lora is not None:
            self._add_adapters(plan, batch)
        logits = self.runner.forward(batch, self.host_kv.take_loads() if self.host_kv is not None else None)
        prompt_logprobs: dict[int, tuple[list, list]] = {}
        if plan.decode:  # one row per part, every part samples
            return PendingStep(plan, self._sample(plan.sampling_reqs, logits, prompt_logprobs))
        rows, reqs, offset = [], [], 0
        spec_tokens: dict[int, list[int]] = {}  # by sampling index
        for index, part in enumerate(plan.parts):
            kept = logits[offset:offset + part.logit_count]
            offset += part.logit_count
            if part.input_logprobs:
                prompt_logprobs[index] = input_logprobs(part.req, kept, part.first_logit_pos)
            if part.verifies:
                if part.req.grammar is not None:
                    apply_draft_grammar_masks(kept, part.req, part.drafts, self._grammar_backend())
                spec_tokens[len(rows) + len(spec_tokens)] = verify_drafts(part.req, kept, part.drafts,
                                                                          draft_probs.get(index),
                                                                          self._streams.get(part.req))
            elif part.samples:
                rows.append(kept[-1])
                reqs.append(part.req)
        sampled = self._sample(reqs, torch.stack(rows), prompt_logprobs) if rows else None
        if not spec_tokens:
            return PendingStep(plan, sampled or (lambda: StepResult([], [], prompt_logprobs)))
        return PendingStep(plan, lambda: _merge_speculated(sampled, spec_tokens, prompt_logprobs))

    def _sample(self, reqs: list[Req], logits: torch.Tensor,
                prompt_logprobs: dict[int, Any]) -> Callable[[], StepResult]:
        """Samples every request's next token on the device and starts copying them to the host;
        returns what reads them (and their logprobs) when the step is committed."""
        top_ks = [r.logprob.top_logprobs_num if r.logprob.return_logprob else None for r in reqs]
        logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in top_ks) else None
        apply_penalties(logits, reqs, self.eos_ids)
        if any(r.grammar is not None for r in reqs):
            apply_grammar_masks(logits, reqs, self._grammar_backend())
        next_ids = sample(logits, reqs, self._streams)
        if self.overlap:
            rows = torch.tensor([r.req_pool_idx for r in reqs]).to(self.device, non_blocking=True)
            self.last_tokens[rows] = next_ids
        tokens = self._transfer.start(next_ids)

        def collect() -> StepResult:
            ids = tokens()
            lps = output_logprobs(logprobs, ids, top_ks) if logprobs is not None else []
            return StepResult(ids, lps, prompt_logprobs)

        return collect


def _merge_speculated(sampled: Callable[[], StepResult] | None, spec_tokens: dict[int, list[int]],
                      prompt_logprobs: dict[int, Any]) -> StepResult:
    """One result in sampling order: verified parts' tokens among the ones sampled plainly."""
    plain = sampled() if sampled is not None else StepResult([], [], prompt_logprobs)
    tokens, logprobs, taken = [], [], 0
    for i in range(len(plain.tokens) + len(spec_tokens)):
        if i in spec_tokens:
            tokens.append(spec_tokens[i][0])
            logprobs.append(None)  # speculating requests asked for none
        else:
            tokens.append(plain.tokens[taken])
            logprobs.append(plain.output_logprobs[taken] if plain.output_logprobs else None)
            taken += 1
    return StepResult(tokens, logprobs if plain.output_logprobs else [], prompt_logprobs, spec_tokens)
