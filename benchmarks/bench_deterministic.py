"""What --enable-deterministic-inference costs: the same workloads on an engine with the flag and
on one without it (the baseline), both measured in this run, radix cache on in both.

Workloads: offline throughput (on a GPU, gpu_workloads.offline_workload: 1000 prompts of U[512, 1536]
tokens, U[128, 384] out; a scaled-down one on CPU), batch-1 decode ms/token, and shared-prefix
throughput (groups of prompts sharing a long prefix). On a GPU each engine first runs a small
version of each workload, untimed (64 offline prompts, two prefix groups): graph buckets, kernel
loads and the first cuBLAS proofs of a shape then fall outside the timing, in both engines.
Prints one JSON line per engine and workload, and one ratio line per workload (flag / baseline;
> 1 is faster for throughput). On a GPU the offline lines also split the device's time: forwards
by step kind, and the gaps between forwards (sampling, and the device waiting for the host)
by the kind of step that followed.

    python -m benchmarks.bench_deterministic [--out FILE]                 # CPU, default model
    python -m benchmarks.bench_deterministic --llama8b --tokenizer-path T  # GPU, 8B shape, dummy weights
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from .engine_runs import StepTimer
from .gpu_workloads import offline_workload, random_prompts, shared_prefix_workload
from .gpu_measure import device_name
from .harness import Reporter, command_line, ratio, run_frame
from .models import add_engine_model_flags, engine_model

SMOLLM_IDS = (200, 49000)  # the default model's ordinary token ids


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _generate(engine, prompts: list[list[int]], out_lens: list[int]) -> None:
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in out_lens]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(out_lens)


def offline(engine, prompts, out_lens) -> dict:
    """Throughput; on a GPU also the device time by step kind and the gaps between forwards
    (engine_runs.StepTimer: CUDA events, which leave overlap scheduling alone)."""
    engine.flush_cache()
    timer = StepTimer(engine.scheduler.engine.runner) if torch.cuda.is_available() else None
    try:
        seconds = _seconds(lambda: _generate(engine, prompts, out_lens))
        split = {}
        if timer is not None:
            split_s, steps = timer.split_s(seconds)
            split = {"split_s": split_s, "gaps_s": timer.gaps(), "steps": steps}
    finally:
        if timer is not None:
            timer.remove()
    engine.flush_cache()
    return {"seconds": round(seconds, 2), "output_tok_s": round(sum(out_lens) / seconds, 1), **split}


def decode_ms(engine, prompt: list[int], short: int, long: int) -> dict:
    """(time for `long` tokens - time for `short`) / (long - short): prefill cancels out."""
    def run(n):
        engine.flush_cache()
        return _seconds(lambda: _generate(engine, [prompt], [n]))
    run(short)  # warm-up
    t_short = min(run(short) for _ in range(3))
    t_long = min(run(long) for _ in range(3))
    return {"ms_per_token": round((t_long - t_short) / (long - short) * 1e3, 3)}


def shared_prefix(engine, prompts, out_len: int) -> dict:
    """Every prompt of every group in one call, the cache flushed first: each group's prefix is
    prefilled once and reused by the rest of the group."""
    engine.flush_cache()
    seconds = _seconds(lambda: _generate(engine, prompts, [out_len] * len(prompts)))
    return {"seconds": round(seconds, 2), "total_tok_s": round(sum(len(p) + out_len for p in prompts) / seconds, 1)}


def workloads(gpu: bool, num_requests: int = 1000, num_groups: int = 8):
    """(name, function of an engine) per workload, sized for the device."""
    if gpu:
        prompts, out_lens = offline_workload(num=num_requests)
        groups = shared_prefix_workload(num_groups=num_groups)
        decode_prompt = random_prompts(random.Random(1), [512])[0]
        return [("offline", lambda e: offline(e, prompts, out_lens)),
                ("batch1_decode", lambda e: decode_ms(e, decode_prompt, 32, 288)),
                ("shared_prefix", lambda e: shared_prefix(e, groups, 64))]
    rng = random.Random(0)
    prompts = random_prompts(rng, [rng.randint(64, 192) for _ in range(48)], SMOLLM_IDS)
    out_lens = [rng.randint(16, 48) for _ in range(48)]
    groups = shared_prefix_workload(num_groups=4, per_group=8, prefix_len=512, unique_len=64, seed=3)
    groups = [[t % (SMOLLM_IDS[1] - SMOLLM_IDS[0]) + SMOLLM_IDS[0] for t in p] for p in groups]
    decode_prompt = random_prompts(random.Random(1), [128], SMOLLM_IDS)[0]
    return [("offline", lambda e: offline(e, prompts, out_lens)),
            ("batch1_decode", lambda e: decode_ms(e, decode_prompt, 8, 72)),
            ("shared_prefix", lambda e: shared_prefix(e, groups, 16))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_model_flags(parser)
    parser.add_argument("--repeats", type=int, default=2, help="runs per workload and engine; the best is kept")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--num-requests", type=int, default=1000, help="GPU: requests of the offline workload")
    parser.add_argument("--workloads", default="offline,batch1_decode,shared_prefix",
                        help="comma-separated: which workloads to run")
    args = parser.parse_args()

    from radixlm.srt import Engine

    gpu = torch.cuda.is_available()
    device = device_name()
    frame = run_frame(device)
    report = Reporter(args.out, command=command_line())
    model_args, model = engine_model(args)
    wanted = args.workloads.split(",")
    runs = [(name, run) for name, run in workloads(gpu, args.num_requests) if name in wanted]
    warm_ups = dict(workloads(gpu, 64, num_groups=2)) if gpu else {}
    if len(runs) != len(wanted):
        parser.error(f"--workloads: choose from offline, batch1_decode, shared_prefix (got {args.workloads})")
    results: dict[str, dict[str, dict]] = {}
    for label, flag in (("baseline", False), ("deterministic", True)):
        engine = Engine(**model_args, enable_deterministic_inference=flag)
        try:
            for name, run in runs:
                if name in warm_ups and name != "batch1_decode":  # decode_ms warms itself
                    warm_ups[name](engine)
                best = None
                for _ in range(args.repeats):
                    got = run(engine)
                    key = next(iter(got))
                    if best is None or got[key] < best[key]:
                        best = got
                results.setdefault(name, {})[label] = best
                report.emit({"bench": "deterministic", "device": device, "model": model, "engine": label,
                             "workload": name, **best, **frame})
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    for name, by_engine in results.items():
        base, det = by_engine["baseline"], by_engine["deterministic"]
        if name == "batch1_decode":
            line = {"ms_per_token_ratio": ratio(det["ms_per_token"], base["ms_per_token"])}
        else:
            key = "output_tok_s" if name == "offline" else "total_tok_s"
            line = {"throughput_ratio": ratio(det[key], base[key])}
        report.emit({"bench": "deterministic", "device": device, "model": model, "workload": name,
                     "vs": "the same engine without --enable-deterministic-inference", **line, **frame})


if __name__ == "__main__":
    main()
