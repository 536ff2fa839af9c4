"""The scheduler's side of structured generation: constrained requests wait here while their
grammar compiles, and every sampled token advances its request's matcher (appending
grammar-forced text: jump-forward). The device engine masks each step's logits with the same
matchers (srt/executor/grammar_mask.py). No torch."""

from __future__ import annotations

from typing import Any, Sequence

from ..scheduler.request import FinishReason, Req
from .grammar_cache import GrammarCache


class ConstrainedDecoding:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], compile_timeout_s: float,
                 jump_forward: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.jump_forward = jump_forward
        self.compiling: list[Req] = []  # requests whose grammar is not ready yet
        self.cache = GrammarCache(self._make_backend, compile_timeout_s)
        self._jump = None  # built with the backend

    def _make_backend(self):
        """Runs in the compile worker on first use: both take a second or so to build."""
        from .jump_forward import JumpForward
        from .xgrammar_backend import XGrammarBackend

        self._jump = JumpForward(self.tokenizer)
        return XGrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)

    # ---- waiting for grammars ----------------------------------------------------------------

    def submit(self, req: Req) -> None:
        req.pending_grammar = self.cache.submit(req.sampling_params.grammar_spec)
        self.compiling.append(req)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, with their matcher; requests whose compile failed,
        finished with the reason)."""
        ready, failed = [], []
        for req in list(self.compiling):
            outcome = req.pending_grammar.result()
            if outcome is None:
                continue
            self.compiling.remove(req)
            req.pending_grammar = None
            compiled, error = outcome
            if error is not None:
                req.finish_reason = FinishReason("abort", message=error)
                failed.append(req)
            else:
                req.grammar = self.cache.backend.new_matcher(compiled)
                ready.append(req)
        return ready, failed

    def wait(self, seconds: float) -> None:
        """Blocks up to `seconds` for the oldest pending compile (instead of spinning)."""
        if self.compiling:
            self.compiling[0].pending_grammar.wait(seconds)

    # ---- each step -------------------------------------------------------------------------------

    def advance(self, req: Req, token: int, room: int) -> FinishReason | None:
        """Feeds the sampled token to the request's matcher; ends the request when the grammar
        is complete, else appends any text the grammar forces, up to `room` more tokens."""
        if not req.grammar.accept_token(token):
            return FinishReason("abort", message=f"internal error: token {token} violates the request's grammar")
        if req.grammar.is_terminated():
            return FinishReason("stop", matched=token)
        sp = req.sampling_params
        # Jumped tokens have no logprobs of their own, and stop strings are looked for near the
        # newest token only: such requests decode every token.
        if self.jump_forward and not (req.logprob.return_logprob or sp.stop or sp.stop_regex):
            jumped = self._jump(req.output_ids, req.grammar, room)
            if jumped is not None:
                req.output_ids[-1:] = jumped
        return None


def valid_draft_len(matcher: Any, drafts: Sequence[int]) -> int:
    """How many leading drafts the grammar admits from the matcher's state (through one that
    completes it, none after); the matcher is left as it was. Speculation drafts no further."""
    accepted = 0
    while accepted < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[accepted]):
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted
