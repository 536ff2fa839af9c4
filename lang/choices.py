"""How `select` turns the logprobs of each choice's tokens into a decision.

A backend scores every choice in one call and hands each method, per choice, the
(logprob, token id) of the choice's tokens after the prompt. Methods (SGLang's names):
- token_length_normalized: the highest mean token logprob;
- greedy_token_selection: token by token, keep the choices whose token scores best (a shorter
  choice continues with its own mean), until one is left;
- unconditional_likelihood_normalized: the highest mean of (logprob after the prompt minus
  logprob of the same token without the prompt), which discounts choices that are likely anyway.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

TokenLogprobs = list[tuple[float, int]]  # one choice: (logprob, token id) per token


@dataclass(frozen=True)
class ChoiceDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod(ABC):
    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def scores(self, logprobs: list[TokenLogprobs], unconditional: list[TokenLogprobs] | None) -> list[float]:
        """One score per choice; the highest wins (ties: the first)."""

    def __call__(self, choices: list[str], logprobs: list[TokenLogprobs],
                 unconditional: list[TokenLogprobs] | None = None, temperature: float = 0.0,
                 rng: random.Random | None = None) -> ChoiceDecision:
        if len(logprobs) != len(choices) or any(not lps for lps in logprobs):
            raise ValueError("select: every choice needs at least one scored token")
        scores = self.scores(logprobs, unconditional)
        if temperature > 0:  # sample in proportion to exp(score / temperature)
            top = max(scores)
            weights = [math.exp((s - top) / temperature) for s in scores]
            index = (rng or random).choices(range(len(choices)), weights)[0]
        else:
            index = max(range(len(choices)), key=scores.__getitem__)
        meta: dict[str, Any] = {
            "scores": scores,
            "normalized_prompt_logprobs": [_mean([lp for lp, _ in lps]) for lps in logprobs],
            "input_token_logprobs": [[[lp, tid, None] for lp, tid in lps] for lps in logprobs],
            "output_token_logprobs": [[] for _ in choices],
            "choices_method": type(self).__name__,
        }
        if unconditional is not None:
            meta["unconditional_token_logprobs"] = [[[lp, tid, None] for lp, tid in u] for u in unconditional]
        return ChoiceDecision(choices[index], meta)


class TokenLengthNormalized(ChoicesMethod):
    def scores(self, logprobs: list[TokenLogprobs], unconditional: list[TokenLogprobs] | None) -> list[float]:
        return [_mean([lp for lp, _ in lps]) for lps in logprobs]


class GreedyTokenSelection(ChoicesMethod):
    def scores(self, logprobs: list[TokenLogprobs], unconditional: list[TokenLogprobs] | None) -> list[float]:
        # A rank turned into a score: 1.0 for the survivor, 0.0 for the rest.
        width = max(len(lps) for lps in logprobs)
        rows = []
        for lps in logprobs:
            values = [lp for lp, _ in lps]
            rows.append(values + [_mean(values)] * (width - len(values)))
        alive = list(range(len(logprobs)))
        for j in range(width):
            best = max(rows[i][j] for i in alive)
            alive = [i for i in alive if rows[i][j] == best]
            if len(alive) == 1:
                break
        return [1.0 if i == alive[0] else 0.0 for i in range(len(logprobs))]


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    requires_unconditional_logprobs = True

    def scores(self, logprobs: list[TokenLogprobs], unconditional: list[TokenLogprobs] | None) -> list[float]:
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        out = []
        for cond, uncond in zip(logprobs, unconditional):
            if len(cond) != len(uncond):
                raise ValueError("select: conditional and unconditional token counts differ")
            out.append(_mean([c - u for (c, _), (u, _) in zip(cond, uncond)]))
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
