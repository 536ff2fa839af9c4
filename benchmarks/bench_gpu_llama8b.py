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
  python benchmarks/bench_gpu_llama8b.py --suites decode,prefill,offline --out benchmarks/results/gpu_h200.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "benchmarks/models/llama-3.1-8b/config.json"
TOKENIZERS = (REPO.parent / "shared/models/llama3-tokenizer-vocab.gguf", REPO / ".whl/llama3-tokenizer")
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


class Reporter:
    def __init__(self, out: str | None, command: str):
        self.out, self.command = out, command

    def emit(self, line: dict) -> None:
        line = {"device": torch.cuda.get_device_name(), **line, "command": self.command}
        text = json.dumps(line)
        print(text, flush=True)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "a") as f:
                f.write(text + "\n")


def timed(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls, GPU work included."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth() -> dict:
    """HBM bandwidth two ways: a read-only reduction over 8 GiB and a device-to-device copy."""
    x = torch.empty(4 * 2**30, dtype=torch.bfloat16, device="cuda").fill_(1)
    y = torch.empty_like(x)
    read_s = timed(lambda: x.sum(dtype=torch.float32), 5)
    copy_s = timed(lambda: y.copy_(x), 5)
    nbytes = x.numel() * 2
    x = y = None  # free the 16 GiB before empty_cache (the lambdas above are done with them)
    torch.cuda.empty_cache()
    return {"read_tb_s": nbytes / read_s / 1e12, "copy_tb_s": 2 * nbytes / copy_s / 1e12}


def measure_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ b
    seconds = timed(lambda: [a @ b for _ in range(10)], 3) / 10
    return 2 * 8192**3 / seconds / 1e12


def random_prompts(rng: random.Random, lens: list[int]) -> list[list[int]]:
    # Ordinary (non-special) ids of the Llama-3 vocabulary.
    return [[rng.randrange(1000, 128000) for _ in range(n)] for n in lens]


# ---- suites ------------------------------------------------------------------------------------


def bench_decode(engine, rep: Reporter, weight_bytes: int, bw: dict) -> None:
    rng = random.Random(1)
    prompt = random_prompts(rng, [128])[0]

    def gen(n):
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
        engine.flush_cache()

    short, long = 32, 288
    gen(long)  # warm-up
    t_short, t_long = timed(lambda: gen(short), 3), timed(lambda: gen(long), 3)
    # The difference cancels prefill and per-request overhead: pure decode steps.
    ms = (t_long - t_short) / (long - short) * 1e3
    best_bw = max(bw["read_tb_s"], bw["copy_tb_s"])
    roofline_ms = weight_bytes / (best_bw * 1e12) * 1e3
    vllm_ms, vllm_ms_record = vllm_recorded("decode_ms_per_token")
    rep.emit({"bench": "gpu_decode_bs1", "prompt_tokens": 128, "ms_per_token": round(ms, 3),
              "tok_s": round(1e3 / ms, 1), "baseline": "roofline weight_bytes/measured_bandwidth",
              "weight_gb": round(weight_bytes / 1e9, 3), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()},
              "roofline_ms": round(roofline_ms, 3), "fraction_of_roofline": round(roofline_ms / ms, 3),
              "goal": ">= 0.9", "vllm_recorded": vllm_ms_record,
              "ratio_vs_vllm_recorded": round(vllm_ms / ms, 3)})
    profile(lambda: gen(16), "batch-1 decode, 16 tokens")
    host_profile(lambda: gen(128), "batch-1 decode, 128 tokens: host time")


def host_profile(fn, title: str, rows: int = 25) -> None:
    """Where the host spends a call of `fn` (Python functions, cumulative)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    print(f"# host profile: {title}", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(rows)


def profile(fn, title: str, rows: int = 18):
    """Prints the kernels that take the GPU time (and the host-side ops) for one call of `fn`;
    returns the profiler's per-name averages."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"# profile: {title}", flush=True)
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    return averages


def bench_prefill(engine, rep: Reporter, config, peak_tflops: float) -> None:
    rng = random.Random(2)
    num, length = 8, 2048

    def run():
        prompts = random_prompts(rng, [length] * num)  # fresh ids: nothing comes from the cache
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
        engine.flush_cache()

    run()
    seconds = timed(run, 3)
    profile(run, "prefill 8 x 2048", rows=12)
    tokens = num * length
    linear = 2 * (config.num_layers * _layer_params(config)) * tokens
    attention = 2 * 2 * config.num_heads * config.head_dim * (length * length / 2) * config.num_layers * num
    tflops = (linear + attention) / seconds / 1e12
    rep.emit({"bench": "gpu_prefill", "prompts": num, "prompt_tokens": length, "seconds": round(seconds, 4),
              "tok_s": round(tokens / seconds), "model_tflops": round(tflops, 1),
              "baseline": "bf16 GEMM 8192^3 measured in this run", "matmul_tflops": round(peak_tflops, 1),
              "mfu_vs_measured_gemm": round(tflops / peak_tflops, 3), "goal": ">= 0.6"})


def _layer_params(config) -> int:
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size


def offline_workload(seed: int = 0, num: int = 1000):
    rng = random.Random(seed)
    in_lens = [rng.randint(512, 1536) for _ in range(num)]
    out_lens = [rng.randint(128, 384) for _ in range(num)]
    return random_prompts(rng, in_lens), out_lens


def hf_generate_seconds(config_dir: Path, prompts, out_lens, attn: str = "sdpa") -> float:
    """Seconds HF `generate` (bf16, random weights) takes for `prompts` in one left-padded batch,
    run to the longest output (warmed up first; the model is freed after)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).eval()
    num, width, new = len(prompts), max(len(p) for p in prompts), max(out_lens)
    ids = torch.zeros((num, width), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        model.generate(input_ids=ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def run_hf_baseline(rep: Reporter, prompts, out_lens, num: int = 128) -> float:
    """HF `generate` (bf16, SDPA) on the first `num` requests in one left-padded batch; the batch
    runs to the longest output, and only each request's own output tokens count."""
    prompts, out_lens = prompts[:num], out_lens[:num]
    seconds = hf_generate_seconds(CONFIG.parent, prompts, out_lens)
    useful = sum(out_lens)
    rep.emit({"bench": "gpu_offline_hf_baseline", "system": "hf_transformers_generate", "requests": num,
              "seconds": round(seconds, 2), "output_tok_s": round(useful / seconds, 1),
              "generated_tok_s_incl_padding_rows": round(num * max(out_lens) / seconds, 1)})
    return useful / seconds


class StepTimer:
    """Wraps the runner's forward to split a run into device time spent in extend forwards, in
    decode forwards, and the rest (sampling, and the device idling while the host works).

    CUDA events, not host clocks: synchronizing after each forward would stop the scheduler
    from preparing the next step while this one runs (overlap scheduling)."""

    def __init__(self, runner):
        self.runner, self.inner = runner, runner.forward
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        runner.forward = self

    def __call__(self, batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(batch)
        end.record()
        self.events.append(("decode" if batch.is_decode else "extend", start, end))
        return out

    def split(self) -> tuple[dict[str, float], dict[str, int]]:
        """(device seconds, steps) per kind, for the forwards since the last reset."""
        torch.cuda.synchronize()
        seconds, steps = {"extend": 0.0, "decode": 0.0}, {"extend": 0, "decode": 0}
        for kind, start, end in self.events:
            seconds[kind] += start.elapsed_time(end) / 1e3
            steps[kind] += 1
        return seconds, steps

    def reset(self):
        self.events = []

    def remove(self):
        """Puts the runner's own forward back and lets go of the runner, so that neither keeps
        the engine's memory alive past its shutdown."""
        del self.runner.forward
        self.runner = self.inner = None


def bench_offline(engine, rep: Reporter, prompts, out_lens, hf_tok_s: float | None) -> None:
    timer = StepTimer(engine.scheduler.engine.runner)

    def run(n):
        params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in out_lens[:n]]
        timer.reset()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts[:n], sampling_params=params)
        seconds = time.perf_counter() - start
        engine.flush_cache()
        assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(out_lens[:n])
        return seconds

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
        device_s, steps = timer.split()
        out_tokens, in_tokens = sum(out_lens[:n]), sum(len(p) for p in prompts[:n])
        line = {"bench": "gpu_offline", "system": "radixlm_engine", "requests": n, "seconds": round(seconds, 2),
                "output_tok_s": round(out_tokens / seconds, 1),
                "total_tok_s": round((out_tokens + in_tokens) / seconds, 1),
                "split_s": {"extend_forward_device": round(device_s["extend"], 2),
                            "decode_forward_device": round(device_s["decode"], 2),
                            "sampling_and_device_idle": round(seconds - sum(device_s.values()), 2)},
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


def free_engine(engine) -> None:
    engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def run_offline(engine, prompts, out_lens) -> dict:
    """Seconds for the whole workload in one generate call (after a 16-request warm-up), with
    the device time split by step kind."""
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in out_lens]
    engine.generate(input_ids=prompts[:16], sampling_params=params[:16])
    engine.flush_cache()
    timer = StepTimer(engine.scheduler.engine.runner)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    device_s, steps = timer.split()
    timer.remove()
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(out_lens)
    out_tokens, in_tokens = sum(out_lens), sum(len(p) for p in prompts)
    return {"seconds": round(seconds, 2), "output_tok_s": round(out_tokens / seconds, 1),
            "total_tok_s": round((out_tokens + in_tokens) / seconds, 1),
            "split_s": {"extend_forward_device": round(device_s["extend"], 2),
                        "decode_forward_device": round(device_s["decode"], 2),
                        "sampling_and_device_idle": round(seconds - sum(device_s.values()), 2)},
            "steps": steps, "kv_tokens": engine.scheduler.allocator.capacity}


def bench_defaults(rep: Reporter, tokenizer: str, prompts, out_lens) -> None:
    """The offline workload on an Engine given no batch settings (what `radixlm serve` gets on
    this GPU: ServerArgs.with_device_defaults) against the CPU-sized defaults every device had
    before (64 requests, 2048-token chunks), and against vLLM's batch cap on such GPUs (1024)."""
    from radixlm.srt import Engine

    runs = (("device defaults", {}), ("previous defaults", {"max_running_requests": 64, "chunked_prefill_size": 2048}),
            ("1024 requests", {"max_running_requests": 1024}))
    results = {}
    for name, kwargs in runs:
        engine = Engine(str(CONFIG), load_format="dummy", tokenizer_path=tokenizer, **kwargs)
        settings = {k: getattr(engine.server_args, k) for k in ("max_running_requests", "chunked_prefill_size",
                                                                 "max_prefill_tokens", "cuda_graph_max_bs")}
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


def shared_prefix_workload(num_groups: int, per_group: int = 16, prefix_len: int = 2048, unique_len: int = 256,
                           seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_groups):
        prefix = random_prompts(rng, [prefix_len])[0]
        prompts += [prefix + p for p in random_prompts(rng, [unique_len] * per_group)]
    rng.shuffle(prompts)
    return prompts


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
        device_s, steps = timer.split()
        timer.remove()
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        results[name] = len(prompts) * out_len / seconds
        line = {"bench": "gpu_shared_prefix", "system": f"radixlm_engine {name}", "groups": groups,
                "prompts": len(prompts), "seconds": round(seconds, 2), "output_tok_s": round(results[name], 1),
                "cached_token_fraction": round(cached / sum(len(p) for p in prompts), 3),
                "split_s": {"extend_forward_device": round(device_s["extend"], 2),
                            "decode_forward_device": round(device_s["decode"], 2),
                            "sampling_and_device_idle": round(seconds - sum(device_s.values()), 2)},
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
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.srt.launch", "--model-path", str(CONFIG), "--load-format",
                             "dummy", "--tokenizer-path", tokenizer, "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        healthy = None
        while time.perf_counter() - start < timeout_s and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.25)
        if healthy is None:
            raise RuntimeError(f"server not ready after {timeout_s}s (exit code {proc.poll()})")
        body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"{base}/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        first = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)
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
    rep = Reporter(args.out, "python " + shlex.join(sys.argv))
    tokenizer = args.tokenizer_path or next(str(p) for p in TOKENIZERS if p.exists())

    bw = measure_bandwidth() if "decode" in suites else None
    peak = measure_matmul_tflops() if "prefill" in suites else None
    prompts, out_lens = offline_workload(num=args.num_requests)
    hf_tok_s = run_hf_baseline(rep, prompts, out_lens) if "offline" in suites and not args.no_hf else None

    from radixlm.srt import Engine
    from radixlm.srt.executor.model_runner import model_bytes

    def make_engine(**overrides):
        return Engine(str(CONFIG), load_format="dummy", tokenizer_path=tokenizer,
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
    start = time.perf_counter()
    engine = make_engine()
    ready_s = time.perf_counter() - start
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
