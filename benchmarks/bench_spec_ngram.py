"""N-gram speculative decoding against plain decoding, on the default model in-process (CPU).

Three workloads (spec_workloads.py: extraction, code_edit, chat), one request at a time
(speculation is for latency), greedy, same prompts and output lengths for both engines, runs
alternating and the median kept. Each line reports the mean accepted length (tokens per verify
step) and the speedup over plain decoding measured in the same run, and checks that the
outputs are identical.

    python -m benchmarks.bench_spec_ngram [--runs 3] [--out benchmarks/results/cpu_spec_ngram.jsonl]

--drafting instead times the host side alone: the n-gram search for a batch of requests, every
step (a step with drafts waits for it), against the Python scan over the token list that the
engine used before (kept here as the baseline), on Zipf-distributed token streams of a few
context lengths; both must propose the same drafts.

    python -m benchmarks.bench_spec_ngram --drafting [--out benchmarks/results/cpu_spec_ngram.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import time

from .harness import Reporter, command_line
from .spec_workloads import WORKLOADS, run


def python_scan_baseline(tokens: list[int], num_drafts: int, max_match: int = 4, min_match: int = 1,
                         window: int = 4096) -> list[int]:
    """The engine's n-gram search before it was vectorized (commit a58d2b7), for --drafting."""
    if num_drafts <= 0 or len(tokens) < min_match + 1:
        return []
    start = max(0, len(tokens) - window)
    for size in range(min(max_match, len(tokens) - 1), min_match - 1, -1):
        suffix = tokens[-size:]
        first = suffix[0]
        pos = len(tokens) - size - 1
        while pos >= start:
            if tokens[pos] == first and tokens[pos:pos + size] == suffix:
                follow = tokens[pos + size:pos + size + num_drafts]
                if follow:
                    return follow
            pos -= 1
    return []


def bench_drafting(args, report: Reporter) -> None:
    import numpy as np

    from radixlm.srt.scheduler.ngram import TokenHistory, propose_ngram

    rng = np.random.default_rng(0)
    vocab, batch, steps = 49152, 64, 32
    for context in (512, 2048, 8192):
        # Zipf-like token frequencies, as text has: a few tokens everywhere, most rare.
        streams = [(rng.zipf(1.2, context + steps) % vocab).tolist() for _ in range(batch)]
        timings = {}
        drafts = {}
        for name in ("baseline", "ours"):
            # As a Req holds them: the prompt, and the output growing by a token a step.
            prompts = [stream[:context] for stream in streams]
            outputs = [[] for _ in streams]
            histories = [TokenHistory() for _ in range(batch)]
            proposed = []
            elapsed = 0.0
            for step in range(steps):
                for stream, output in zip(streams, outputs):
                    output.append(stream[context + step])
                start = time.perf_counter()
                for prompt, output, history in zip(prompts, outputs, histories):
                    if name == "baseline":  # it searched Req.fill_ids, prompt + output
                        proposed.append(python_scan_baseline(prompt + output, args.draft_tokens))
                    else:
                        proposed.append(propose_ngram(history.sync(prompt, output), args.draft_tokens))
                elapsed += time.perf_counter() - start
            timings[name] = elapsed / (steps * batch) * 1e6
            drafts[name] = proposed
        report.emit({"bench": "spec_ngram_drafting", "context_tokens": context, "batch": batch, "steps": steps,
                     "draft_tokens": args.draft_tokens, "ours_us_per_request_step": round(timings["ours"], 1),
                     "baseline": "the Python scan over the token list used before, measured in this run",
                     "baseline_us_per_request_step": round(timings["baseline"], 1),
                     "speedup": round(timings["baseline"] / timings["ours"], 1),
                     "ours_ms_per_step_at_batch": round(timings["ours"] * batch / 1e3, 3),
                     "baseline_ms_per_step_at_batch": round(timings["baseline"] * batch / 1e3, 3),
                     "same_drafts": drafts["ours"] == drafts["baseline"],
                     "with_drafts": sum(bool(d) for d in drafts["ours"]) / len(drafts["ours"])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--workloads", default="extraction,code_edit,chat")
    parser.add_argument("--drafting", action="store_true", help="time the host-side n-gram search alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Reporter(args.out, command=command_line())
    if args.drafting:
        bench_drafting(args, report)
        return
    from radixlm.srt import Engine

    plain = Engine(max_total_tokens=16384)
    spec = Engine(max_total_tokens=16384, speculative_algorithm="ngram",
                  speculative_num_draft_tokens=args.draft_tokens)
    for name in args.workloads.split(","):
        prompts = WORKLOADS[name]
        run(plain, prompts[:1], 4)
        run(spec, prompts[:1], 4)  # warm-up (and the prompts' first prefill is the same for both)
        ours, base = [], []
        sched = spec.scheduler
        steps0, accepted0 = sched.spec_verify_steps, sched.spec_accepted_tokens
        for _ in range(args.runs):
            seconds, spec_ids = run(spec, prompts, args.max_new_tokens)
            ours.append(seconds)
            seconds, plain_ids = run(plain, prompts, args.max_new_tokens)
            base.append(seconds)
        steps, accepted = sched.spec_verify_steps - steps0, sched.spec_accepted_tokens - accepted0
        tokens = sum(len(ids) for ids in plain_ids)
        speedup = statistics.median(base) / statistics.median(ours)
        report.emit({"bench": "spec_ngram", "workload": name, "requests": len(prompts), "batch": 1,
                     "output_tokens": tokens, "draft_tokens": args.draft_tokens,
                     "mean_accepted_length": round(1 + accepted / steps, 3) if steps else None,
                     "verify_steps_per_run": steps // args.runs,
                     "same_outputs": spec_ids == plain_ids, "ours_s": round(statistics.median(ours), 3),
                     "baseline": "same engine settings, no speculation",
                     "baseline_s": round(statistics.median(base), 3),
                     "all_ours": [round(s, 3) for s in ours], "all_baseline": [round(s, 3) for s in base],
                     "speedup": round(speedup, 3),
                     "goal": {"extraction": ">= 1.5", "chat": ">= 0.95"}.get(name, "report")})


if __name__ == "__main__":
    main()
