"""The grammar-backend interface the scheduler uses: compile a spec once, then one matcher per
request that masks each step's logits and follows the tokens the request emits."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from .spec import GrammarSpec

if TYPE_CHECKING:  # the scheduler's side of grammars runs without torch
    import torch


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) when the grammar forbids it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into row `row` of a CPU bitmask."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token was accepted."""

    @abc.abstractmethod
    def jump_forward_string(self) -> str:
        """The text the grammar forces next (may be empty)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""


class GrammarBackend(abc.ABC):
    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """A compiled grammar for `spec` (called from a worker thread; may take seconds)."""

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abc.abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU bitmask with room for `rows` requests, every token allowed."""

    @abc.abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Sets the logits of forbidden tokens to -inf, in place, for the listed rows."""


def valid_draft_len(matcher: GrammarMatcher, drafts: list[int]) -> int:
    """How many leading drafts the grammar admits from the matcher's state (through one that
    completes it, none after); the matcher is left as it was. Speculation drafts no further."""
    accepted = 0
    while accepted < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[accepted]):
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted
