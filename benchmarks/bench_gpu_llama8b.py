"""GPU benchmarks on the Llama-3.1-8B shape (bf16, dummy weights). Prints one JSON line per
result and appends them to --out. A line's "baseline" names what it is compared to in the same
run (a ceiling measured here, HF `generate`, a feature turned off); start-up times have none.

  decode   batch-1 decode ms/token vs the roofline: weight bytes / HBM bandwidth measured here
  prefill  8 prompts x 2048 tokens: model FLOP utilisation vs the bf16 GEMM ceiling measured here
  offline  vLLM's 1000-request workload (input U[512,1536], output U[128,384], ignore_eos,
           token-id prompts); HF `generate` on the first 128 requests (and radixlm on the same
           128) and overlap scheduling off as the in-run baselines; prefill/decode split
  shared_prefix  64 groups x 16 prompts (2048 shared + 256 unique, 128 out), shuffled; the
           radix cache turned off as the in-run baseline
  constrained  64 JSON-schema requests: jump-forward on vs off, vs unconstrained decoding
  serve_ready  `radixlm serve` process start to /health and to a first /generate
  defaults  the offline workload with no batch flags (the GPU's defaults) vs the CPU-sized
           defaults used before (64 requests, 2048-token chunks) and vs 1024 requests at once
  (always) Engine construction time (load, graphs)

vLLM is not run here. Its figures (decode, offline, shared_prefix, start to ready) are recorded
ones: vLLM 0.24.0 on the same workloads on this project's H200 machine, 2026-11-29 (rerun
2026-11-30), from ../shared/gpu/README.md. Lines carry them as "vllm_recorded" with date,
version and machine, and the ratio as "ratio_vs_vllm_recorded"; never as a baseline.

Run on the H200 (see README, "GPU"):
  python -m benchmarks.bench_gpu_llama8b --suites decode,prefill,offline --out benchmarks/results/gpu_h200.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import httpx
import torch

from .engine_runs import (StepTimer, decode_ms_per_token, free_engine, greedy, host_profile, offline_seconds,
                          prefill_flops, profile, run_offline)
from .gpu_measure import gpu_reporter, gpu_seconds, measure_bandwidth, measure_matmul_tflops
from .gpu_workloads import offline_workload, random_prompts, shared_prefix_workload
from .harness import Reporter, ServerProcess, timed
from .hf_baseline import hf_generate_seconds
from .models import LLAMA3_TOKENIZER_GGUF, LLAMA_8B_CONFIG

# Peer figures NOT measured in this run (see the module docstring): per metric, the recorded
# figures by date; ratios use the first (2026-11-29, the figures the README's table compares to).
VLLM_VERSION = "0.24.0"
VLLM_MACHINE = "1x NVIDIA H200 (this project's GPU machine)"
VLLM_SOURCE = "../shared/gpu/README.md"
VLLM_RECORDED = {
    "decode_ms_per_token": {"2026-11-29": 4.835, "2026-11-30": 4.843},
    "offline_output_tok_s": {"2026-11-29": 5962.0, "2026-11-30": 6027.6},
    "shared_prefix_output_tok_s": {"2026-11-29": 5759.0, "2026-11-30": 5859.0},
    # 2026-11-30 measured the in-process LLM() start (105 s, cold), not a server's start to ready.
    "start_to_ready_s": {"2026-11-29": 136.0},
}


def vllm_recorded(metric: str) -> tuple[float, dict]:
    """(the figure ratios use, the "vllm_recorded" object a line carries) for `metric`."""
    figures = VLLM_RECORDED[metric]
    date, value = next(iter(figures.items()))
    return value, {metric: value, "date": date, "version": VLLM_VERSION, "machine": VLLM_MACHINE,
                   "other_dates": {d: v for d, v in figures.items() if d != date}, "source": VLLM_SOURCE,
                   "measured_in_this_run": False}


# ---- suites ------------------------------------------------------------------------------------


def bench_decode(engine, rep: Reporter, weight_bytes: int, bw: dict) -> None:
    prompt = random_prompts(random.Random(1), [128])[0]
    ms = decode_ms_per_token(engine, prompt)
    best_bw = max(bw["read_tb_s"], bw["copy_tb_s"])
    roofline_ms = weight_bytes / (best_bw * 1e12) * 1e3
    vllm_ms, vllm_ms_record = vllm_recorded("decode_ms_per_token")
    rep.emit({"bench": "gpu_decode_bs1", "prompt_tokens": 128, "ms_per_token": round(ms, 3),
              "tok_s": round(1e3 / ms, 1), "baseline": "roofline weight_bytes/measured_bandwidth",
              "weight_gb": round(weight_bytes / 1e9, 3), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()},
              "roofline_ms": round(roofline_ms, 3), "fraction_of_roofline": round(roofline_ms / ms, 3),
              "goal": ">= 0.9", "vllm_recorded": vllm_ms_record,
              "ratio_vs_vllm_recorded": round(vllm_ms / ms, 3)})
    profile(lambda: greedy(engine, prompt, 16), "batch-1 decode, 16 tokens")
    host_profile(lambda: greedy(engine, prompt, 128), "batch-1 decode, 128 tokens: host time")


def bench_prefill(engine, rep: Reporter, config, peak_tflops: float) -> None:
    rng = random.Random(2)
    num, length = 8, 2048

    def run():
        prompts = random_prompts(rng, [length] * num)  # fresh ids: nothing comes from the cache
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
        engine.flush_cache()

    run()
    seconds = gpu_seconds(run, 3)
    profile(run, "prefill 8 x 2048", rows=12)
    tokens = num * length
    tflops = prefill_flops(config, num, length) / seconds / 1e12
    rep.emit({"bench": "gpu_prefill", "prompts": num, "prompt_tokens": length, "seconds": round(seconds, 4),
              "tok_s": round(tokens / seconds), "model_tflops": round(tflops, 1),
              "baseline": "bf16 GEMM 8192^3 measured in this run", "matmul_tflops": round(peak_tflops, 1),
              "mfu_vs_measured_gemm": round(tflops / peak_tflops, 3), "goal": ">= 0.6"})


def run_hf_baseline(rep: Reporter, prompts, out_lens, num: int = 128) -> float:
    """HF `generate` (bf16, SDPA) on the first `num` requests in one left-padded batch; the batch
    runs to the longest output, and only each request's own output tokens count."""
    prompts, out_lens = prompts[:num], out_lens[:num]
    seconds = hf_generate_seconds(LLAMA_8B_CONFIG.parent, prompts, out_lens)
    useful = sum(out_lens)
    rep.emit({"bench": "gpu_offline_hf_baseline", "system": "hf_transformers_generate", "requests": num,
              "seconds": round(seconds, 2), "output_tok_s": round(useful / seconds, 1),
              "generated_tok_s_incl_padding_rows": round(num * max(out_lens) / seconds, 1)})
    return useful / seconds


def bench_offline(engine, rep: Reporter, prompts, out_lens, hf_tok_s: float | None) -> None:
    timer = StepTimer(engine.scheduler.engine.runner)

    def run(n):
        timer.reset()
        return offline_seconds(engine, prompts[:n], out_lens[:n])

    run(16)  # warm-up
    sched = engine.scheduler
    if sched.overlap:  # what overlap scheduling gains, on the first 128 requests
        sched.overlap = False
        lockstep = run(128)
        sched.overlap = True
        overlapped = run(128)
        rep.emit({"bench": "gpu_offline_overlap", "requests": 128, "overlap_s": round(overlapped, 2),
                  "baseline": "same engine, overlap scheduling off", "lockstep_s": round(lockstep, 2),
                  "speedup": round(lockstep / overlapped, 3)})
    for n in (128, len(prompts)):
        seconds = run(n)
        split, steps = timer.split_s(seconds)
        out_tokens, in_tokens = sum(out_lens[:n]), sum(len(p) for p in prompts[:n])
        line = {"bench": "gpu_offline", "system": "radixlm_engine", "requests": n, "seconds": round(seconds, 2),
                "output_tok_s": round(out_tokens / seconds, 1),
                "total_tok_s": round((out_tokens + in_tokens) / seconds, 1), "split_s": split,
                "steps": steps, "overlap_schedule": sched.overlap}
        if hf_tok_s:
            line.update(baseline="hf_transformers_generate first 128 requests",
                        ratio_vs_hf=round(out_tokens / seconds / hf_tok_s, 2))
        if n == len(prompts):
            vllm_tok_s, record = vllm_recorded("offline_output_tok_s")
            line.update(vllm_recorded=record, ratio_vs_vllm_recorded=round(out_tokens / seconds / vllm_tok_s, 3),
                        goal=">= 1.1")
        rep.emit(line)
    timer.remove()


def bench_defaults(rep: Reporter, tokenizer: str, prompts, out_lens) -> None:
    """The offline workload on an Engine given no batch settings (what `radixlm serve` gets on
    this GPU: ServerArgs.with_device_defaults) against the CPU-sized defaults every device had
    before (64 requests, 2048-token chunks), and against vLLM's batch cap on such GPUs (1024)."""
    from radixlm.srt import Engine

    runs = (("device defaults", {}), ("previous defaults", {"max_running_requests": 64, "chunked_prefill_size": 2048}),
            ("1024 requests", {"max_running_requests": 1024}))
    results = {}
    for name, kwargs in runs:
        engine = Engine(str(LLAMA_8B_CONFIG), load_format="dummy", tokenizer_path=tokenizer, **kwargs)
        flat = engine.server_args.to_dict()
        settings = {k: flat[k] for k in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                                         "cuda_graph_max_bs")}
        results[name] = {"settings": settings, **run_offline(engine, prompts, out_lens)}
        free_engine(engine)
    base = results["previous defaults"]
    vllm_tok_s, record = vllm_recorded("offline_output_tok_s")
    rep.emit({"bench": "gpu_offline_defaults", "requests": len(prompts), "system": "device defaults",
              **results["device defaults"], "baseline": "previous defaults, same workload, measured in this run",
              "baseline_result": base,
              "speedup_vs_baseline": round(base["seconds"] / results["device defaults"]["seconds"], 3),
              "max_running_1024": results["1024 requests"],
              "vllm_recorded": record,
              "ratio_vs_vllm_recorded": round(results["device defaults"]["output_tok_s"] / vllm_tok_s, 3)})


def bench_shared_prefix(make_engine, rep: Reporter, num_groups: int, baseline_groups: int) -> None:
    """64 groups x 16 prompts sharing 2048 tokens (+256 unique, 128 out), shuffled; the same
    workload (fewer groups, to save time; a rate is compared) with the radix cache off."""

    out_len = 128
    params = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    results = {}
    for name, groups, kwargs in (("radix_cache", num_groups, {}),
                                 ("disable_radix_cache", baseline_groups, {"disable_radix_cache": True})):
        engine = make_engine(**kwargs)
        engine.generate(input_ids=shared_prefix_workload(1, 4, seed=99), sampling_params=params)  # warm-up
        engine.flush_cache()
        prompts = shared_prefix_workload(groups)
        timer = StepTimer(engine.scheduler.engine.runner)
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        split, steps = timer.split_s(seconds)
        timer.remove()
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        results[name] = len(prompts) * out_len / seconds
        line = {"bench": "gpu_shared_prefix", "system": f"radixlm_engine {name}", "groups": groups,
                "prompts": len(prompts), "seconds": round(seconds, 2), "output_tok_s": round(results[name], 1),
                "cached_token_fraction": round(cached / sum(len(p) for p in prompts), 3), "split_s": split,
                "steps": steps}
        if name == "disable_radix_cache":
            line.update(ratio_radix_vs_no_cache=round(results["radix_cache"] / results[name], 2))
        else:
            vllm_tok_s, record = vllm_recorded("shared_prefix_output_tok_s")
            line.update(vllm_recorded=record, ratio_vs_vllm_recorded=round(results[name] / vllm_tok_s, 3),
                        goal=">= 1.3")
        rep.emit(line)
        engine.shutdown()
        del engine, outs, timer  # the timer holds the runner: the next engine needs its memory
        gc.collect()
        torch.cuda.empty_cache()


# Only bounded values (enums, bounded integers, booleans): a random model cannot run a string or a
# number on to max_tokens, and the keys and punctuation are text the grammar forces.
CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {"category": {"enum": ["hardware failure", "software defect", "billing question"]},
                   "priority_level": {"type": "integer", "minimum": 0, "maximum": 9},
                   "needs_escalation": {"type": "boolean"},
                   "customer_sentiment": {"enum": ["positive", "neutral", "negative"]}},
    "required": ["category", "priority_level", "needs_escalation", "customer_sentiment"]}


def bench_constrained(engine, rep: Reporter, num: int = 64) -> None:
    """64 JSON-schema requests at once: jump-forward on vs off (forced text appended without a
    decode step per token, but the batch runs as an eager extend step), and unconstrained
    decoding of the same number of tokens per request as the in-run baseline."""
    rng = random.Random(5)
    prompts = random_prompts(rng, [256] * num)
    params = {"json_schema": json.dumps(CONSTRAINED_SCHEMA), "temperature": 0, "max_new_tokens": 96}
    constraints = engine.scheduler.constraints
    engine.generate(input_ids=prompts[:2], sampling_params=params)  # compiles the grammar once
    engine.flush_cache()

    def run(sampling_params):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sampling_params)
        seconds = time.perf_counter() - start
        engine.flush_cache()
        return seconds, outs

    results = {}
    for jump in (True, False):
        constraints.jump_forward = jump
        results[jump] = run(params)
    constraints.jump_forward = True
    on_s, outs = results[True]
    off_s, off_outs = results[False]
    assert all(json.loads(o["text"]).keys() == CONSTRAINED_SCHEMA["properties"].keys() for o in outs)
    lens = [o["meta_info"]["completion_tokens"] for o in off_outs]
    free_s, _ = run([{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lens])
    rep.emit({"bench": "gpu_constrained", "requests": num, "jump_forward_on_s": round(on_s, 3),
              "jump_forward_off_s": round(off_s, 3), "jump_forward_speedup": round(off_s / on_s, 3),
              "output_tokens_off": sum(lens), "baseline": "unconstrained, same token counts",
              "unconstrained_s": round(free_s, 3), "constrained_off_vs_unconstrained": round(free_s / off_s, 3)})


def bench_serve_ready(rep: Reporter, tokenizer: str, timeout_s: float = 240.0) -> None:
    """`radixlm serve` on the 8B shape: process start until /health answers and a first
    /generate returns (imports, weights, KV pool, CUDA graphs, child processes included)."""
    server = ServerProcess("--model-path", str(LLAMA_8B_CONFIG), "--load-format", "dummy", "--tokenizer-path",
                           tokenizer, wait=False)
    try:
        healthy = server.wait_ready(timeout_s)
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        assert httpx.post(f"{server.base_url}/generate", json=body, timeout=60, trust_env=False).status_code == 200
        first = time.perf_counter() - server.started
    finally:
        server.stop()
    vllm_s, record = vllm_recorded("start_to_ready_s")
    rep.emit({"bench": "gpu_serve_ready", "seconds_to_health": round(healthy, 1),
              "seconds_to_first_generate": round(first, 1), "vllm_recorded": record,
              "ratio_vs_vllm_recorded": round(vllm_s / healthy, 2), "goal": "< 60 s"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="decode,prefill,offline")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline of the offline suite")
    parser.add_argument("--max-running-requests", type=int, default=512)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=512)
    parser.add_argument("--chunked-prefill-size", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--shared-prefix-groups", type=int, default=64)
    parser.add_argument("--shared-prefix-baseline-groups", type=int, default=16,
                        help="groups for the radix-cache-off baseline (a rate is compared)")
    args = parser.parse_args()
    suites = set(args.suites.split(","))
    rep = gpu_reporter(args.out)
    tokenizer = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)

    bw = measure_bandwidth() if "decode" in suites else None
    peak = measure_matmul_tflops() if "prefill" in suites else None
    prompts, out_lens = offline_workload(num=args.num_requests)
    hf_tok_s = run_hf_baseline(rep, prompts, out_lens) if "offline" in suites and not args.no_hf else None

    from radixlm.srt import Engine
    from radixlm.srt.executor.model_runner import model_bytes

    def make_engine(**overrides):
        return Engine(str(LLAMA_8B_CONFIG), load_format="dummy", tokenizer_path=tokenizer,
                      max_running_requests=args.max_running_requests, cuda_graph_max_bs=args.cuda_graph_max_bs,
                      chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.chunked_prefill_size,
                      page_size=args.page_size, disable_cuda_graph=args.disable_cuda_graph,
                      disable_overlap_schedule=args.disable_overlap_schedule, **overrides)

    if "serve_ready" in suites:
        bench_serve_ready(rep, tokenizer)
        suites.discard("serve_ready")
    if "defaults" in suites:
        bench_defaults(rep, tokenizer, prompts, out_lens)
        suites.discard("defaults")
    if not suites:
        return
    if suites == {"shared_prefix"}:
        bench_shared_prefix(make_engine, rep, args.shared_prefix_groups, args.shared_prefix_baseline_groups)
        return
    torch.cuda.synchronize()
    engine, ready_s = timed(make_engine)
    config = engine.model_config
    vllm_s, record = vllm_recorded("start_to_ready_s")
    rep.emit({"bench": "gpu_engine_ready", "seconds": round(ready_s, 1), "vllm_recorded": record,
              "ratio_vs_vllm_recorded": round(vllm_s / ready_s, 2),
              "note": "in-process Engine (dummy weights, CUDA graphs), without interpreter/import time",
              "kv_tokens": engine.scheduler.allocator.capacity})
    if "decode" in suites:
        bench_decode(engine, rep, model_bytes(config, torch.bfloat16), bw)
    if "prefill" in suites:
        bench_prefill(engine, rep, config, peak)
    if "offline" in suites:
        bench_offline(engine, rep, prompts, out_lens, hf_tok_s)
    if "constrained" in suites:
        bench_constrained(engine, rep)
    if "shared_prefix" in suites:
        engine.shutdown()
        del engine
        bench_shared_prefix(make_engine, rep, args.shared_prefix_groups, args.shared_prefix_baseline_groups)


if __name__ == "__main__":
    main()
