"""The grammar backend on xgrammar: compiled grammars with precomputed token masks, matchers
that produce a bitmask per step in microseconds, and jump-forward strings."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import xgrammar

from .backend import GrammarBackend, GrammarMatcher
from .spec import JSON_FORMAT, GrammarSpec, choices_to_ebnf

COMPILER_CACHE_BYTES = 256 * 2**20


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int = 2):
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is unbounded by default: a server sees endless distinct schemas.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=num_threads, cache_limit_bytes=COMPILER_CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value)
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.value, **JSON_FORMAT)
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.value)
        if spec.kind == "choices":
            return self._compiler.compile_grammar(choices_to_ebnf(spec.choices))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def new_matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
