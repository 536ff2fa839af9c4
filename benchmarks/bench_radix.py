"""Radix prefix cache throughput on a ~1M-token tree, against a naive linear-scan matcher.

The tree is shaped like serving traffic: few-shot prompts (groups sharing a long ~800-token
prefix, each prompt with a unique ~100-token tail) and multi-turn chats (each turn re-inserts
the whole history). Then new requests of both kinds are matched and inserted into the full
tree. The baseline keeps the inserted sequences in a list and scans all of them for the
longest common prefix (with the same slice-based comparison helper, so the ratio measures the
data structure, not the comparison loop); being slow, it runs on a small sample of the same
requests. Prints one JSON line per result.

    python -m benchmarks.bench_radix [--quick] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.radix import RadixCache, common_prefix_len

from .harness import Reporter, ratio, timed

VOCAB_SIZE = 128256  # Llama-3 vocabulary: realistic token-id spread


@dataclass(frozen=True)
class Workload:
    fewshot_groups: int
    prompts_per_group: int
    shared_len: int
    tail_len: int
    conversations: int
    turns: int
    user_len: int
    reply_len: int
    queries_per_kind: int
    baseline_queries: int


FULL = Workload(50, 100, 800, 100, 200, 10, 100, 150, 2000, 20)
QUICK = Workload(10, 20, 800, 100, 40, 5, 100, 150, 500, 10)


class SlotCounter:
    """Hands out fresh slot indices; duplicates handed back are simply dropped (no eviction)."""

    def __init__(self) -> None:
        self.next_slot = 0

    def alloc(self, n: int) -> list[int]:
        start = self.next_slot
        self.next_slot += n
        return list(range(start, start + n))


class NaiveCache:
    """The baseline: every inserted sequence in a list; match scans them all."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []

    def match_len(self, key: list[int]) -> int:
        best = 0
        for seq in self.seqs:
            if seq and key and seq[0] == key[0]:
                best = max(best, common_prefix_len(seq, key))
        return best

    def insert(self, key: list[int]) -> int:
        cached = self.match_len(key)
        self.seqs.append(key)
        return cached


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def as_request(seq: list[int]) -> list[int]:
    """A copy with fresh int objects, as a tokenizer would hand over: comparisons with the
    tree's keys then compare values, not just object identity (as they would in a server)."""
    return array("l", seq).tolist()


def build_sequences(w: Workload, rng: random.Random) -> tuple[list[list[int]], list[list[int]],
                                                                list[list[int]]]:
    """(insert order for the tree, few-shot prefixes, final chat histories).

    Every sequence gets a random arrival time; a chat's turns get increasing times, so the
    kinds interleave while each turn still extends the one inserted before it.
    """
    timeline: list[tuple[float, list[int]]] = []
    prefixes = [tokens(rng, w.shared_len) for _ in range(w.fewshot_groups)]
    for prefix in prefixes:
        timeline += [(rng.random(), as_request(prefix + tokens(rng, w.tail_len)))
                     for _ in range(w.prompts_per_group)]
    histories: list[list[int]] = []
    for _ in range(w.conversations):
        history: list[int] = []
        for arrival in sorted(rng.random() for _ in range(w.turns)):
            history = history + tokens(rng, w.user_len + w.reply_len)
            timeline.append((arrival, as_request(history)))
        histories.append(history)
    timeline.sort(key=lambda item: item[0])
    return [seq for _, seq in timeline], prefixes, histories


def with_reply(rng: random.Random, w: Workload, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, prompt + output): the key a finished request inserts reuses its prompt ids."""
    return prompt, prompt + as_request(tokens(rng, w.reply_len))


def new_requests(w: Workload, rng: random.Random, prefixes: list[list[int]],
                 histories: list[list[int]]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per kind: (prompt to match, prompt + output to insert) for requests not seen yet."""
    fewshot = []
    for _ in range(w.queries_per_kind):
        prompt = rng.choice(prefixes) + tokens(rng, w.tail_len)
        fewshot.append(with_reply(rng, w, as_request(prompt)))
    multiturn = []
    for _ in range(w.queries_per_kind):
        prompt = rng.choice(histories) + tokens(rng, w.user_len)
        multiturn.append(with_reply(rng, w, as_request(prompt)))
    return {"fewshot": fewshot, "multiturn": multiturn}


def seconds_for_each(fn: Callable[[list], object], items: list) -> float:
    """Seconds to call fn on each item (results dropped, as a scheduler drops them soon)."""
    def each() -> None:
        for item in items:
            fn(item)

    gc.collect()  # start each measurement from the same collector state
    return timed(each)[1]


def rate_line(bench: str, workload: str, tree_tokens: int, ops: int, token_count: int,
              seconds: float, base_ops: int, base_seconds: float, **extra: object) -> dict:
    ops_per_s = ops / seconds
    base_ops_per_s = base_ops / base_seconds
    return {
        "bench": bench, "workload": workload, "tree_tokens": tree_tokens, "ops": ops,
        "ops_per_s": round(ops_per_s, 1), "tokens_per_s": round(token_count / seconds),
        "baseline": "naive_linear_scan", "baseline_ops": base_ops,
        "baseline_ops_per_s": round(base_ops_per_s, 2),
        "ratio": ratio(ops_per_s, base_ops_per_s, 1),
        **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~100k-token tree, a few seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    w = QUICK if args.quick else FULL
    rng = random.Random(args.seed)

    inserts, prefixes, histories = build_sequences(w, rng)
    requests = new_requests(w, rng, prefixes, histories)
    slots = SlotCounter()
    cache = RadixCache(capacity=1 << 40, free_slots=lambda freed: None)
    naive = NaiveCache()

    build_s = seconds_for_each(lambda key: cache.insert(key, slots.alloc(len(key))), inserts)
    naive.seqs = list(inserts)  # its build cost is the scans measured below, on a sample
    tree_tokens = cache.total_size
    report = Reporter(None)
    report.emit({"bench": "radix_build", "tree_tokens": tree_tokens, "nodes": cache.node_count(),
                 "inserts": len(inserts), "inserted_tokens": sum(map(len, inserts)), "seconds": round(build_s, 3),
                 "baseline": "naive_linear_scan", "baseline_sequences": len(naive.seqs)})

    for kind, reqs in requests.items():
        sample = reqs[:w.baseline_queries]
        cache.reset_stats()
        match_s = seconds_for_each(lambda req: cache.match_prefix(req[0]), reqs)
        hit_rate = round(cache.stats["hit_rate"], 4)
        base_s = seconds_for_each(lambda req: naive.match_len(req[0]), sample)
        report.emit(rate_line("radix_match", kind, tree_tokens, len(reqs),
                        sum(len(p) for p, _ in reqs), match_s, len(sample), base_s,
                        hit_rate=hit_rate))

    for kind, reqs in requests.items():
        sample = reqs[:w.baseline_queries]
        fresh = [(full, slots.alloc(len(full))) for _, full in reqs]  # allocation not timed
        insert_s = seconds_for_each(lambda item: cache.insert(*item), fresh)
        base_s = seconds_for_each(lambda req: naive.insert(req[1]), sample)
        report.emit(rate_line("radix_insert", kind, cache.total_size, len(reqs),
                        sum(len(full) for full, _ in fresh), insert_s, len(sample), base_s))


if __name__ == "__main__":
    main()
