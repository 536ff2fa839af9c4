"""Synthetic, seeded serving workloads made of token ids, so every prompt length is exact.

Prompts are drawn from a pool of "word-like" vocabulary entries (a letter run, optionally
with a leading space), which reads like text to the model without being any real corpus.
They are sent as `input_ids`, so no re-tokenization changes their length.

A workload is a list of conversations. Single-shot datasets (`random`, `shared-prefix`) are
conversations of one turn. A multi-turn conversation's turn t prompt is the turn t-1 prompt,
then the ids the model answered at turn t-1, then the new user ids of turn t; so turn t can
only be built (and sent) after turn t-1 returned.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_WORDLIKE = re.compile(r"^ ?[A-Za-z]{1,12}$")


@dataclass(frozen=True)
class Turn:
    user_ids: tuple[int, ...]  # the new ids this turn appends (the whole prompt for turn 0)
    output_len: int


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]

    def prompt_ids(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn `turn`'s full prompt, given the output ids of the turns before it."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        ids: list[int] = []
        for t in range(turn):
            ids += self.turns[t].user_ids
            ids += answers[t]
        return ids + list(self.turns[turn].user_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]
    params: dict  # what built it, for the report

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def is_multi_turn(self) -> bool:
        return any(len(c.turns) > 1 for c in self.conversations)


def wordlike_token_pool(tokenizer) -> list[int]:
    """Vocabulary ids that decode to a short letter run (optionally space-led), no specials."""
    special = set(tokenizer.all_special_ids)
    pool = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        if _WORDLIKE.match(tokenizer.decode([token_id])):
            pool.append(token_id)
    if len(pool) < 100:
        raise ValueError(f"tokenizer: only {len(pool)} word-like tokens; cannot build prompts")
    return pool


def _ids(rng: random.Random, pool: list[int], length: int) -> tuple[int, ...]:
    return tuple(rng.choice(pool) for _ in range(length))


def _span(rng: random.Random, center: int, range_ratio: float) -> int:
    """A length uniform in [center*(1-r), center*(1+r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range ratio: must be in [0, 1)")
    low = max(1, round(center * (1 - range_ratio)))
    high = max(low, round(center * (1 + range_ratio)))
    return rng.randint(low, high)


def random_workload(pool: list[int], num_prompts: int, input_len: int, output_len: int,
                    input_range_ratio: float, output_range_ratio: float, seed: int) -> Workload:
    rng = random.Random(seed)
    convs = tuple(
        Conversation((Turn(_ids(rng, pool, _span(rng, input_len, input_range_ratio)),
                           _span(rng, output_len, output_range_ratio)),))
        for _ in range(num_prompts))
    params = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
              "input_range_ratio": input_range_ratio, "output_range_ratio": output_range_ratio, "seed": seed}
    return Workload("random", convs, params)


def shared_prefix_workload(pool: list[int], num_groups: int, prompts_per_group: int, prefix_len: int,
                           suffix_len: int, output_len: int, seed: int) -> Workload:
    """G groups x P prompts: a per-group prefix of `prefix_len` ids + a unique suffix; shuffled."""
    rng = random.Random(seed)
    convs = []
    for _ in range(num_groups):
        prefix = _ids(rng, pool, prefix_len)
        for _ in range(prompts_per_group):
            convs.append(Conversation((Turn(prefix + _ids(rng, pool, suffix_len), output_len),)))
    rng.shuffle(convs)
    params = {"num_groups": num_groups, "prompts_per_group": prompts_per_group, "prefix_len": prefix_len,
              "suffix_len": suffix_len, "output_len": output_len, "seed": seed}
    return Workload("shared-prefix", tuple(convs), params)


def multi_turn_workload(pool: list[int], num_conversations: int, num_turns: int, first_len: int,
                        user_len: int, output_len: int, seed: int) -> Workload:
    """C conversations x T turns: a `first_len`-id opening, then `user_len` new ids per turn."""
    rng = random.Random(seed)
    convs = tuple(
        Conversation(tuple(Turn(_ids(rng, pool, first_len if t == 0 else user_len), output_len)
                           for t in range(num_turns)))
        for _ in range(num_conversations))
    params = {"num_conversations": num_conversations, "num_turns": num_turns, "first_len": first_len,
              "user_len": user_len, "output_len": output_len, "seed": seed}
    return Workload("multi-turn", convs, params)
