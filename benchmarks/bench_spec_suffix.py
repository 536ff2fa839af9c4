"""Suffix speculation against no speculation and against n-gram speculation, on an agent trace
(spec_workloads.py `agent`: tool-call JSON replies that repeat across trips, prompts quoting
the earlier calls). Greedy, the same prompts and output lengths for the three engines, runs
alternating and the median kept; the suffix store is emptied before each run, so a run drafts
only from its own earlier requests. Each line reports both ratios measured in the same run,
accepted lengths, forwards (prefill + decode + verify steps) and whether outputs match.

    python -m benchmarks.bench_spec_suffix [--runs 3] [--out benchmarks/results/cpu_spec_suffix.jsonl]

CPU: the embedded default model in-process, batch 1. --gpu: the real default model (--gguf,
SmolLM2-135M-Instruct) at batch 1 and 16 (requests of a wave run together; a larger trace of
distinct trips):

    python -m benchmarks.bench_spec_suffix --gpu --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out benchmarks/results/gpu_h200_spec.jsonl

--drafting instead times the host side alone: one request step's suffix search (a step with
drafts waits for it) against a full store (--speculative-suffix-max-tokens' default) of
Zipf-distributed outputs, and the n-gram search on the same request tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from .harness import Reporter, command_line, run_frame
from .spec_workloads import WORKLOADS, agent_trace, trips


def run_waves(engine, prompts: list[str], batch: int, max_new: int) -> tuple[float, list[list[int]]]:
    """(seconds, output ids): the prompts in waves of `batch` requests decoded together."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    start, ids = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        wave = prompts[i:i + batch]
        outs = engine.generate(wave, params) if len(wave) > 1 else [engine.generate(wave[0], params)]
        ids += [o["output_ids"] for o in outs]
    return time.perf_counter() - start, ids


def compare(engines: dict, prompts: list[str], batch: int, args, frame: dict, report: Reporter) -> None:
    """Alternating runs of each engine on `prompts`; one line with suffix's ratios to the others."""
    for engine in engines.values():
        run_waves(engine, prompts[:1], 1, 4)  # warm-up (and the first prompt's prefill, for all alike)
    seconds = {name: [] for name in engines}
    stats = {}
    for name, engine in engines.items():
        sched = engine.scheduler
        stats[name] = (sched.spec_verify_steps, sched.spec_accepted_tokens, sched.steps_launched)
    outputs = {}
    for _ in range(args.runs):
        for name, engine in engines.items():
            if name == "suffix":
                engine.scheduler.decode.suffix.clear()
            took, outputs[name] = run_waves(engine, prompts, batch, args.max_new_tokens)
            seconds[name].append(took)
    line = {"bench": "spec_suffix", "workload": "agent", "requests": len(prompts), "batch": batch,
            "output_tokens": sum(len(ids) for ids in outputs["none"]), "draft_tokens": args.draft_tokens}
    for name, engine in engines.items():
        sched = engine.scheduler
        steps0, accepted0, forwards0 = stats[name]
        steps, accepted = sched.spec_verify_steps - steps0, sched.spec_accepted_tokens - accepted0
        line[f"{name}_s"] = round(statistics.median(seconds[name]), 3)
        line[f"{name}_all_s"] = [round(s, 3) for s in seconds[name]]
        line[f"{name}_forwards_per_run"] = (sched.steps_launched - forwards0) // args.runs
        if name != "none":
            line[f"{name}_mean_accepted_length"] = round(1 + accepted / steps, 3) if steps else None
            line[f"{name}_verify_steps_per_run"] = steps // args.runs
            line[f"{name}_same_outputs"] = sum(a == b for a, b in zip(outputs[name], outputs["none"]))
    line["baseline"] = "none: same engine settings, no speculation; ngram: n-gram speculation, same draft tokens"
    line["speedup_vs_none"] = round(line["none_s"] / line["suffix_s"], 3)
    line["speedup_vs_ngram"] = round(line["ngram_s"] / line["suffix_s"], 3)
    # Forwards do not depend on what else the machine runs (a shared CPU's times do).
    line["forwards_ratio_vs_none"] = round(line["none_forwards_per_run"] / line["suffix_forwards_per_run"], 3)
    line["forwards_ratio_vs_ngram"] = round(line["ngram_forwards_per_run"] / line["suffix_forwards_per_run"], 3)
    line["goal"] = ">= 1.8 vs none, >= 1.2 vs ngram" if batch == 1 else "report"
    report.emit({**line, **frame})


def bench_drafting(args, report: Reporter, frame: dict) -> None:
    import numpy as np

    from radixlm.srt.scheduler.ngram import propose_ngram
    from radixlm.srt.scheduler.suffix import SuffixStore

    rng = np.random.default_rng(0)
    store = SuffixStore(1 << 16)
    while store.tokens + 300 <= store.max_tokens:  # outputs of 200 tokens after 24 of prompt
        store.add(None, (rng.zipf(1.2, 200) % 49152).tolist(), (rng.zipf(1.2, 24) % 49152).tolist())
    for context in (512, 4096):
        requests = [(rng.zipf(1.2, context) % 49152).astype(np.int32) for _ in range(64)]
        timings, found = {}, {}
        for name, propose in (("suffix", lambda t: store.propose(None, t, args.draft_tokens)),
                              ("ngram", lambda t: propose_ngram(t, args.draft_tokens))):
            start = time.perf_counter()
            found[name] = [propose(tokens) for tokens in requests]
            timings[name] = (time.perf_counter() - start) / len(requests) * 1e6
        report.emit({"bench": "spec_suffix_drafting", "context_tokens": context, "store_tokens": store.tokens,
                     "draft_tokens": args.draft_tokens, "suffix_us_per_request_step": round(timings["suffix"], 1),
                     "baseline": "the n-gram search on the same tokens, this run",
                     "baseline_ngram_us_per_request_step": round(timings["ngram"], 1),
                     "suffix_with_drafts": sum(map(bool, found["suffix"])) / len(requests), **frame})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=16, help="both algorithms' draft budget per step")
    parser.add_argument("--gpu", action="store_true", help="the real default model (--gguf) at batch 1 and 16")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--batch-sizes", default=None, help="default: 1 (CPU), 1,16 (--gpu)")
    parser.add_argument("--drafting", action="store_true", help="time the host-side suffix search alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gpu and not args.gguf:
        parser.error("--gpu needs --gguf PATH (the default model's GGUF)")
    report = Reporter(args.out, command=command_line())
    if args.drafting:
        frame = run_frame("cpu")
        bench_drafting(args, report, frame)
        return
    from radixlm.srt import Engine

    model = [args.gguf] if args.gpu else []
    common = {"max_total_tokens": 65536 if args.gpu else 16384}
    engines = {"suffix": Engine(*model, speculative_algorithm="suffix", speculative_num_draft_tokens=args.draft_tokens,
                                **common),
               "ngram": Engine(*model, speculative_algorithm="ngram", speculative_num_draft_tokens=args.draft_tokens,
                               **common),
               "none": Engine(*model, **common)}
    if args.gpu:
        import torch

        device = torch.cuda.get_device_name()
    else:
        device = "cpu"
    frame = {"model": "SmolLM2-135M-Instruct" + (" (Q4_1 GGUF, bf16)" if args.gpu else " (embedded default), float32"),
             **run_frame(device)}
    batches = args.batch_sizes or ("1,16" if args.gpu else "1")
    for batch in map(int, batches.split(",")):
        # Larger batches: distinct trips, each run twice (the second time in a later wave).
        prompts = WORKLOADS["agent"] if batch == 1 else agent_trace(trips(batch) * 2)
        compare(engines, prompts, batch, args, frame, report)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
