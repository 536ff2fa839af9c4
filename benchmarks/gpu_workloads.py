"""The GPU benchmarks' token-id workloads, seeded: random prompts of ordinary ids, vLLM's offline
workload and groups of prompts sharing a prefix. Ids default to the Llama-3 vocabulary's
ordinary (non-special) ones."""

from __future__ import annotations

import random

LLAMA3_IDS = (1000, 128000)


def random_prompts(rng: random.Random, lens: list[int], ids: tuple[int, int] = LLAMA3_IDS) -> list[list[int]]:
    """One prompt per length, each id drawn from range(*ids)."""
    return [[rng.randrange(*ids) for _ in range(n)] for n in lens]


def offline_workload(seed: int = 0, num: int = 1000,
                     ids: tuple[int, int] = LLAMA3_IDS) -> tuple[list[list[int]], list[int]]:
    """vLLM's offline throughput workload: (prompts of U[512, 1536] tokens, output lengths U[128, 384])."""
    rng = random.Random(seed)
    in_lens = [rng.randint(512, 1536) for _ in range(num)]
    out_lens = [rng.randint(128, 384) for _ in range(num)]
    return random_prompts(rng, in_lens, ids), out_lens


def shared_prefix_workload(num_groups: int, per_group: int = 16, prefix_len: int = 2048, unique_len: int = 256,
                           seed: int = 3) -> list[list[int]]:
    """`num_groups` groups of `per_group` prompts, each a group's shared prefix and a unique tail, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_groups):
        prefix = random_prompts(rng, [prefix_len])[0]
        prompts += [prefix + p for p in random_prompts(rng, [unique_len] * per_group)]
    rng.shuffle(prompts)
    return prompts
