"""CPU projections through oneDNN over packed weights (srt/executor/cpu_linear.py) against
F.linear (MKL), the default model in the in-process Engine, both measured in this run.

Two engines in one process, one with `disable_onednn_linear=True` (the baseline); each workload
runs on both in turn, --repeats times, alternating which goes first, best of the repeats:
- batch1_decode: ms per output token of one request (prompt ~20 tokens, 64 out);
- batch16_decode: ms per decode step of 16 requests with ~360-token contexts (their prompts
  cached, 33 tokens out minus 1 out);
- prefill: prompt tokens/s of 4 cold ~360-token prompts, one output token.
One JSON line per workload and system, one with the ratios (> 1: oneDNN faster), and whether
the greedy outputs were the same.

    python -m benchmarks.bench_cpu_linear [--repeats 3] [--out benchmarks/results/cpu_linear.jsonl]
"""

from __future__ import annotations

import argparse
import random
from datetime import date
from typing import Any, Callable

import torch

from .harness import Reporter, command_line, ratio, timed

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def workloads(engine) -> dict[str, tuple[Callable[[], tuple[float, Any]], Callable[[float], float], str]]:
    """name -> (run returning (seconds, outputs), seconds -> figure, unit)."""
    tok = engine.tokenizer
    contexts = [tok.encode(f"Task {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(350)),
                           add_special_tokens=False) for i in range(16)]
    short = tok.encode("The capital of France is", add_special_tokens=False)

    def batch1() -> tuple[float, Any]:
        engine.flush_cache()
        out, seconds = timed(engine.generate, input_ids=short, sampling_params=greedy(64))
        return seconds, out

    def decode16() -> tuple[float, Any]:
        engine.generate(input_ids=contexts, sampling_params=greedy(1))  # prompts cached, one step
        out, seconds = timed(engine.generate, input_ids=contexts, sampling_params=greedy(33))
        return seconds, out

    def prefill() -> tuple[float, Any]:
        engine.flush_cache()
        out, seconds = timed(engine.generate, input_ids=contexts[:4], sampling_params=greedy(1))
        return seconds, out

    prefill_tokens = sum(len(c) for c in contexts[:4])
    return {
        "batch1_decode": (batch1, lambda s: s / 64 * 1000, "ms_per_token"),
        "batch16_decode": (decode16, lambda s: s / 32 * 1000, "ms_per_step"),
        "prefill": (prefill, lambda s: prefill_tokens / s, "tokens_per_s"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default="2-core CPU devel box")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from radixlm.srt import Engine

    systems = {"onednn_packed": Engine(max_total_tokens=20000),
               "f_linear_mkl": Engine(max_total_tokens=20000, disable_onednn_linear=True)}
    runs = {name: workloads(engine) for name, engine in systems.items()}
    best: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], Any] = {}
    order = list(systems)
    for repeat in range(args.repeats):
        for workload in runs[order[0]]:
            for name in order if repeat % 2 == 0 else order[::-1]:
                run = runs[name][workload][0]
                if repeat == 0:
                    run()  # warm-up
                seconds, out = run()
                best[name, workload] = min(best.get((name, workload), seconds), seconds)
                outputs[name, workload] = out
    for engine in systems.values():
        engine.shutdown()

    framing = {"date": date.today().isoformat(), "machine": args.machine, "threads": torch.get_num_threads(),
               "model": "SmolLM2-135M-Instruct (embedded default), float32", "repeats": args.repeats}
    report = Reporter(args.out, command_line(), device=lambda: "cpu")
    for workload, (_, figure, unit) in runs[order[0]].items():
        values = {name: figure(best[name, workload]) for name in order}
        for name in order:
            report.emit({"bench": "cpu_linear", "workload": workload, "system": name,
                         unit: round(values[name], 2), **framing})
        faster = (ratio(values["onednn_packed"], values["f_linear_mkl"]) if unit == "tokens_per_s"
                  else ratio(values["f_linear_mkl"], values["onednn_packed"]))
        report.emit({"bench": "cpu_linear_ratio", "workload": workload, "system": "onednn_packed",
                     "baseline": "f_linear_mkl: the same Engine with disable_onednn_linear, measured in this run",
                     "speedup": faster,
                     "same_outputs": _ids(outputs["onednn_packed", workload]) == _ids(outputs["f_linear_mkl", workload]),
                     **framing})


def _ids(out: Any) -> Any:
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


if __name__ == "__main__":
    main()
