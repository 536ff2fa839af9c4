"""The scheduler's side of structured generation: constrained requests wait here while their
grammar compiles, and every sampled token advances its request's matcher (appending
grammar-forced text: jump-forward). The device engine masks each step's logits with the same
matchers (srt/executor/grammar_mask.py). No torch."""

from __future__ import annotations

from typing import Any, Sequence

from ..constrained.grammar_cache import GrammarCache, PendingGrammar
from ..core.request import FinishReason, Req


class ConstrainedDecoding:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], compile_timeout_s: float,
                 jump_forward: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.jump_forward = jump_forward
        self.compiling: dict[Req, PendingGrammar] = {}  # requests whose grammar is not ready yet
        self.cache = GrammarCache(self._make_backend, compile_timeout_s)
        self._jump = None  # built with the backend

    def _make_backend(self):
        """Runs in the compile worker on first use: both take a second or so to build."""
        from ..constrained.jump_forward import JumpForward
        from ..constrained.xgrammar_backend import XGrammarBackend

        self._jump = JumpForward(self.tokenizer)
        return XGrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)

    # ---- waiting for grammars ----------------------------------------------------------------

    def submit(self, req: Req) -> None:
        self.compiling[req] = self.cache.submit(req.sampling_params.grammar_spec)

    def abort(self, rid: str) -> Req | None:
        """Takes a request out of the compile wait (its compile goes on, cached for others)."""
        for req in self.compiling:
            if req.rid == rid:
                del self.compiling[req]
                return req
        return None

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, with their matcher; requests whose compile failed,
        finished with the reason)."""
        ready, failed = [], []
        for req, pending in list(self.compiling.items()):
            outcome = pending.result()
            if outcome is None:
                continue
            del self.compiling[req]
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
            next(iter(self.compiling.values())).wait(seconds)

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
