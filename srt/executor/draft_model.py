"""Draft-model speculation (--speculative-algorithm draft, SGLang's STANDALONE): a smaller model
with the target's tokenizer drafts each speculating request's next tokens, one forward per
draft; the target verifies them in one forward (executor/speculative.py).

The draft's KV lives in a second pool indexed by the target's slots (the same req-to-token
table), so whatever the policy does to a slot holds for both models at once: a radix-cache hit
reuses both KVs, accepted tokens keep both, rejected drafts' slots are freed for both, and
eviction and aborts need nothing of their own. Invariant: every slot with the target's KV holds
the draft's KV of the same token. So the draft runs on every forward the target runs: the same
batch for prefill chunks and plain steps; in a verify step it feeds each speculating request's
newest token and its drafts (one forward each, the last draft too, though its logits go
unused), and any other part of the step in one extend forward.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ..constrained.backend import GrammarBackend, valid_draft_len
from ..core.request import Req
from ..core.step import StepPlan
from ..server_args import ServerArgs
from .batch_builder import build_extend_batch, build_token_batch
from .forward_batch import ForwardBatch
from .mem_pool import KVPool, kv_cache_torch_dtype
from .model_runner import ModelRunner, kv_slots_for, model_bytes, rank_config
from .parallel import TensorParallel
from .sampler import SeededStreams, filter_probs

logger = logging.getLogger(__name__)


def load_draft_model(args: ServerArgs, target=None, with_weights: bool = True):
    """The draft model, checked against the target's vocabulary when `target` is given."""
    from .model_loader import load_model

    draft = load_model(args.speculative.speculative_draft_model_path, dtype=args.model.resolved_dtype(),
                       load_format="dummy" if args.model.load_format == "dummy" else "auto",
                       device=args.model.resolved_device(), with_weights=with_weights)
    if target is not None:
        check_same_vocabulary(target, draft)
    return draft


def check_same_vocabulary(target, draft) -> None:
    """Drafts are token ids the target scores: both models must read them the same way."""
    t_name, d_name = target.model_path, draft.model_path
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"speculative_draft_model_path: the draft model {d_name} has a vocabulary of "
                         f"{draft.config.vocab_size} tokens and the target {t_name} one of "
                         f"{target.config.vocab_size}; they must share a tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError(f"speculative_draft_model_path: the draft model {d_name} and the target {t_name} "
                             "have different tokenizers (the same vocabulary size, other tokens); they must "
                             "share one")


def kv_slots_with_draft(config, args: ServerArgs, tp: TensorParallel) -> int:
    """KV slots when every slot holds both models' K/V: the target-only budget in bytes, less the
    draft's weights (counted twice: the loaded copy and the runner's), over both models' bytes
    per token. As the target-only figure where it is fixed (--max-total-tokens, CPU). Under
    tensor parallelism the draft is whole on rank 0, where this runs: the target's part of a
    token is the rank's (the other ranks, without a draft, have room for at least as many)."""
    target_only = kv_slots_for(config, args, tp)
    if args.cache.max_total_tokens is not None or args.model.resolved_device() == "cpu":
        return target_only
    draft = load_draft_model(args, with_weights=False).config
    dtype = args.model.resolved_dtype()
    kv_dtype = kv_cache_torch_dtype(args.model.kv_cache_dtype, dtype)  # as kv_slots_for counted the target's
    per_token = [KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
                 for c in (rank_config(config, tp), draft)]
    budget = target_only * per_token[0] - 2 * model_bytes(draft, dtype, args.model.quantization)
    slots = int(budget // sum(per_token))
    if slots < 4096:
        raise ValueError(f"mem_fraction_static: {args.cache.mem_fraction_static} leaves no room for the KV cache of "
                         "the target and draft models")
    return slots


class DraftModel:
    def __init__(self, target, args: ServerArgs, req_to_token: torch.Tensor, num_kv_slots: int):
        draft = load_draft_model(args, target)
        context_len = args.model.context_length or target.config.context_len
        if draft.config.context_len < context_len:
            raise ValueError(f"speculative_draft_model_path: the draft model {draft.model_path} reads "
                             f"{draft.config.context_len} tokens of context, fewer than the {context_len} served "
                             f"(the target {target.model_path}); pass --context-length {draft.config.context_len}")
        # Under tensor parallelism the draft runs whole on rank 0, outside the ranks' collectives:
        # it is small, and its forwards (one per draft) then cost no messages to the other ranks,
        # which only ever see the target's batches.
        # The draft drafts for the base model: adapters are the target's (its verify step applies them).
        draft_args = args.replace(enable_lora=False, lora_paths=None) if args.lora.enable_lora else args
        self.runner = ModelRunner(draft, draft_args, req_to_token, num_kv_slots, tp=TensorParallel())
        self.device = self.runner.device
        logger.info("draft model %s: %d layers, hidden %d", draft.model_path, draft.config.num_layers,
                    draft.config.hidden_size)

    @torch.inference_mode()
    def follow(self, batch: ForwardBatch) -> None:
        """Writes the draft's KV for a batch the target runs (one without drafts)."""
        self.runner.forward(batch)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, grammar_backend: Callable[[], GrammarBackend], streams: SeededStreams
                ) -> tuple[StepPlan, dict[int, torch.Tensor]]:
        """`plan` with each `model_drafts` part's drafts filled in, the draft's KV written for every
        token of the plan; and, by part index, the distributions q the drafts of sampling
        requests were drawn from ([drafts, vocab]; greedy requests have none). A constrained
        request drafts under its grammar's masks, and its drafts end where the grammar does
        (its part then verifies fewer, perhaps none)."""
        spec = [p for p in plan.parts if p.model_drafts]
        plain = [dataclasses.replace(p, logit_count=0) for p in plan.parts if not p.model_drafts]
        if plain:
            self.follow(build_extend_batch(plain, self.device))
        reqs = [p.req for p in spec]
        most = max(p.model_drafts for p in spec)
        draft_ids = torch.zeros((len(spec), most), dtype=torch.int64, device=self.device)
        newest = self._on_device([p.req.fill_ids[p.start] for p in spec])
        q_rows: list[list[torch.Tensor]] = [[] for _ in spec]
        grammars = _DraftGrammars(reqs, grammar_backend)
        # Forward i feeds token i of each part (its newest token, then its drafts) at start + i;
        # a part's last forward feeds its last draft, for the KV only.
        for i in range(most + 1):
            active = [j for j, p in enumerate(spec) if i <= p.model_drafts]
            fed = newest if i == 0 else draft_ids[:, i - 1]
            if len(active) < len(spec):
                fed = fed[self._on_device(active)]
            logits = self.runner.forward(build_token_batch([spec[j] for j in active], i, fed, self.device))
            drawing = [row for row, j in enumerate(active) if i < spec[j].model_drafts]
            if not drawing:
                break
            rows = [active[row] for row in drawing]
            logits = logits[drawing]
            grammars.mask(logits, rows)
            tokens, probs = draw_drafts(logits, [reqs[j] for j in rows], streams)
            grammars.accept(tokens, rows)
            draft_ids[self._on_device(rows), i] = tokens
            for r, j in enumerate(rows):
                if probs is not None and not reqs[j].sampling_params.is_greedy:
                    q_rows[j].append(probs[r])
        grammars.restore()
        ids = draft_ids.tolist()  # the step's one wait for the device before the target verifies
        parts, q_by_index, j = [], {}, 0
        for index, part in enumerate(plan.parts):
            if part.model_drafts:
                drafts = ids[j][:part.model_drafts]
                if part.req.grammar is not None:
                    drafts = drafts[:valid_draft_len(part.req.grammar, drafts)]
                n = 1 + len(drafts)
                parts.append(dataclasses.replace(part, drafts=drafts, extend_len=n, slots=part.slots[:n], logit_count=n))
                if q_rows[j] and drafts:
                    q_by_index[index] = torch.stack(q_rows[j][:len(drafts)])
                j += 1
            else:
                parts.append(part)
        return dataclasses.replace(plan, parts=parts), q_by_index

    def _on_device(self, values: list[int]) -> torch.Tensor:
        # Non-blocking: a blocking copy would wait for the draft forwards queued before it.
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)


class _DraftGrammars:
    """The grammars of a step's constrained drafting requests: each draft step's logits are
    masked by the state after the drafts before it, then the matchers are put back."""

    def __init__(self, reqs: list[Req], backend: Callable[[], GrammarBackend]):
        self.reqs, self.backend = reqs, backend
        self.accepted = {j: 0 for j, r in enumerate(reqs) if r.grammar is not None}
        self.live = set(self.accepted)  # still inside their grammar

    def mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        masked = [r for r, j in enumerate(rows) if j in self.live and not self.reqs[j].grammar.is_terminated()]
        if not masked:
            return
        backend = self.backend()
        bitmask = backend.allocate_bitmask(len(rows))
        for r in masked:
            self.reqs[rows[r]].grammar.fill_bitmask(bitmask, r)
        backend.apply_bitmask(logits, bitmask, masked)

    def accept(self, tokens: torch.Tensor, rows: list[int]) -> None:
        drawn = [(r, j) for r, j in enumerate(rows) if j in self.live]
        if not drawn:
            return
        host = tokens.tolist()  # a wait for the device per draft step, for constrained requests only
        for r, j in drawn:
            if self.reqs[j].grammar.accept_token(host[r]):
                self.accepted[j] += 1
            else:  # past its end: the drafts from here on are cut
                self.live.discard(j)

    def restore(self) -> None:
        for j, count in self.accepted.items():
            if count:
                self.reqs[j].grammar.rollback(count)


def draw_drafts(logits: torch.Tensor, reqs: list[Req], streams: SeededStreams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's draft: the argmax for greedy requests, else a draw from the draft's
    distribution q at the request's temperature, top-k/top-p/min-p (normalised; returned too,
    for the rejection test). Seeded requests draw from their own stream."""
    params = [r.sampling_params for r in reqs]
    if all(p.is_greedy for p in params):
        return logits.argmax(dim=-1), None
    temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params]).to(logits.device, non_blocking=True)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        probs = filter_probs(probs, params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    tokens = logits.argmax(dim=-1)
    for row, req in enumerate(reqs):
        if params[row].is_greedy:
            continue
        tokens[row] = torch.multinomial(probs[row], 1, generator=streams.get(req))[0]
    return tokens, probs

