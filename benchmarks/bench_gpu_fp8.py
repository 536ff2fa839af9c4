"""FP8 on one H200 (issue 13, part 2). Prints one JSON line per result, each with its baseline
measured in the same run, and appends them to --out. Suites (--suites, comma-separated; each
call should fit in a few minutes):

  decode      Llama-3.1-8B shape, dummy weights: FP8 batch-1 decode ms/token vs the FP8 roofline
              (the weight bytes a step reads / HBM bandwidth measured here; goal <= 2.4 ms) and vs
              bf16 batch-1 decode (a bf16 engine measured here); also without PDL
  prefill     8 prompts x 2048 tokens with FP8 weights: model FLOP utilisation vs an FP8 GEMM
              (torch._scaled_mm 8192^3, row-wise scales) measured here (goal >= 0.6); also with
              quantization in its own kernel instead of in the norms and SiLU-and-mul
  offline     the 1000-request offline workload (gpu_workloads.py) with FP8 weights vs bf16 weights (both
              measured here); vLLM's recorded FP8 figure printed as recorded (goal >= 1.1x)
  offline_kv  the same workload, FP8 weights + FP8 KV vs FP8 weights + bf16 KV (goal >= 1.15x)
  decode_profile  decode steps of the offline workload's size (384 requests, 1024 cached tokens
              each), FP8 KV vs bf16 KV (FP8 weights): ms per step, the attention kernel's
              share and bandwidth, the kernels of each
  accuracy    the real default model (--gguf PATH, SmolLM2-135M): FP8 vs bf16 greedy agreement
              on 64 prompts x 32 tokens and the mean |d logprob| of the bf16 model's tokens

The Llama-3.1-8B config is the one in benchmarks/models; the timers are engine_runs.py's, as
bench_gpu_llama8b's are.

Run on the H200 (see README, "GPU"), e.g.:
  python -m benchmarks.bench_gpu_fp8 --suites decode,prefill --out benchmarks/results/gpu_h200_fp8.jsonl
  python -m benchmarks.bench_gpu_fp8 --suites offline --out benchmarks/results/gpu_h200_fp8.jsonl
  python -m benchmarks.bench_gpu_fp8 --suites offline_kv --out benchmarks/results/gpu_h200_fp8.jsonl
  python -m benchmarks.bench_gpu_fp8 --suites accuracy --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from .engine_runs import StepTimer, decode_ms_per_token, free_engine, prefill_flops, profile, run_offline
from .gpu_measure import gpu_reporter, gpu_seconds, measure_bandwidth
from .gpu_workloads import offline_workload, random_prompts
from .harness import Reporter
from .models import LLAMA3_TOKENIZER_GGUF, LLAMA_8B_CONFIG

# vLLM's FP8 figures: NOT measured in this run (recorded on this project's H200 machine).
VLLM_FP8_RECORDED = {"decode_ms_per_token": 3.478, "offline_seconds": 32.58, "offline_output_tok_s": 7951.0,
                     "date": "2026-11-30", "version": "0.24.0", "quantization": "fp8 (per-tensor online, CUTLASS)",
                     "kv_cache": "bf16", "machine": "1x NVIDIA H200 (this project's GPU machine)",
                     "source": "issue 13", "measured_in_this_run": False}

SUITES = ("decode", "prefill", "offline", "offline_kv", "accuracy", "decode_profile")


# ---- decode ------------------------------------------------------------------------------------


def bench_decode(make_engine, rep: Reporter) -> None:
    from radixlm.srt.executor.model_runner import model_bytes

    bw = measure_bandwidth()
    best_bw = max(bw.values()) * 1e12
    ms = {}
    # fp8: the default dispatch (fp8_gemv up to GEMV_MAX_ROWS rows); fp8_scaled_mm: every batch
    # through quantize + torch._scaled_mm, captured into the graphs as such.
    # fp8_no_pdl: the default path with our kernels launched plainly (see srt/executor/pdl.py).
    # fp8_unfused_rotary: the rotation and the KV store as two kernels (the default fuses them).
    fp8 = {"quantization": "fp8"}
    for name, kwargs in (("bf16", {}), ("fp8", fp8), ("fp8_no_pdl", {**fp8, "disable_pdl": True}),
                         ("fp8_unfused_rotary", {**fp8, "disable_fused_rotary_store": True}),
                         ("fp8_scaled_mm", {**fp8, "disable_fp8_gemv": True})):
        engine = make_engine(max_running_requests=8, cuda_graph_max_bs=8, **kwargs)
        ms[name] = decode_ms_per_token(engine, random_prompts(random.Random(1), [128])[0])
        # Where the rest of the step goes, kernel by kernel: profiled without PDL, whose kernels
        # overlap (each one's profiled time would include its wait for the one before).
        if name == "fp8_no_pdl":
            prompt = random_prompts(random.Random(1), [128])[0]
            profile(lambda: engine.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "max_new_tokens": 64, "ignore_eos": True}),
                "fp8 batch-1 decode without PDL, 64 tokens", rows=25)
        config = engine.model_config
        free_engine(engine)
    fp8_bytes = model_bytes(config, torch.bfloat16, "fp8")
    # A step reads every weight once except the embedding table, of which it reads one row (the
    # LM head is its own matrix in Llama-3.1-8B).
    embedding_bytes = config.vocab_size * config.hidden_size * 2
    step_bytes = fp8_bytes - embedding_bytes * (not config.tie_word_embeddings)
    roofline_ms = step_bytes / best_bw * 1e3
    rep.emit({"bench": "gpu_fp8_decode_bs1", "prompt_tokens": 128, "ms_per_token": round(ms["fp8"], 3),
              "tok_s": round(1e3 / ms["fp8"], 1), "baseline": "bf16 weights, batch-1 decode, measured in this run",
              "bf16_ms_per_token": round(ms["bf16"], 3), "speedup_vs_bf16": round(ms["bf16"] / ms["fp8"], 3),
              "fp8_default_path": "fp8_gemv (Triton) <= 16 rows",
              "fp8_scaled_mm_ms_per_token": round(ms["fp8_scaled_mm"], 3),
              "fp8_without_pdl_ms_per_token": round(ms["fp8_no_pdl"], 3),
              "pdl_speedup": round(ms["fp8_no_pdl"] / ms["fp8"], 3),
              "fp8_unfused_rotary_store_ms_per_token": round(ms["fp8_unfused_rotary"], 3),
              "fused_rotary_store_speedup": round(ms["fp8_unfused_rotary"] / ms["fp8"], 3),
              "fp8_weight_gb": round(fp8_bytes / 1e9, 3), "bytes_read_per_step_gb": round(step_bytes / 1e9, 3), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()},
              "fp8_roofline_ms": round(roofline_ms, 3), "fraction_of_fp8_roofline": round(roofline_ms / ms["fp8"], 3),
              "goal": "<= 2.4 ms/token", "vllm_fp8_recorded": VLLM_FP8_RECORDED,
              "ratio_vs_vllm_fp8_recorded": round(VLLM_FP8_RECORDED["decode_ms_per_token"] / ms["fp8"], 3)})


# ---- prefill -----------------------------------------------------------------------------------


def measure_fp8_gemm_tflops(n: int = 8192) -> float:
    """torch._scaled_mm n^3 with row-wise scales and bf16 output: the ceiling our FP8 GEMMs use."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)  # [N, K]; the GEMM reads b.t()
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")

    def run():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    run()
    seconds = gpu_seconds(lambda: [run() for _ in range(10)], 3) / 10
    return 2 * n**3 / seconds / 1e12


def set_fp8_options(engine, **changes) -> None:
    """Changes the kernel options of an engine's FP8 projections (one engine, both ways)."""
    import dataclasses

    from radixlm.srt.executor.quantization.fp8 import Fp8Linear

    for module in engine.scheduler.engine.runner.model.modules():
        if isinstance(module, Fp8Linear):
            module.options = dataclasses.replace(module.options, **changes)


def bench_prefill(make_engine, rep: Reporter) -> None:
    peak = measure_fp8_gemm_tflops()
    engine = make_engine(quantization="fp8", max_running_requests=16, cuda_graph_max_bs=16)
    config = engine.model_config
    rng = random.Random(2)
    num, length = 8, 2048

    def run():
        prompts = random_prompts(rng, [length] * num)  # fresh ids: nothing from the cache
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
        engine.flush_cache()

    run()
    seconds = gpu_seconds(run, 3)
    profile(run, "fp8 prefill, 8 x 2048 tokens", rows=25)
    # The same prefill with the norms and SiLU-and-mul leaving quantization to its own kernel
    # (--disable-fused-fp8-quantization, set on this engine's projections).
    set_fp8_options(engine, fused_fp8_quantization=False)
    separate_seconds = gpu_seconds(run, 3)
    free_engine(engine)
    tokens = num * length
    tflops = prefill_flops(config, num, length) / seconds / 1e12
    rep.emit({"bench": "gpu_fp8_prefill", "prompts": num, "prompt_tokens": length, "seconds": round(seconds, 4),
              "tok_s": round(tokens / seconds), "model_tflops": round(tflops, 1),
              "baseline": "FP8 GEMM 8192^3 (torch._scaled_mm, row-wise scales, bf16 out) measured in this run",
              "fp8_gemm_tflops": round(peak, 1), "mfu_vs_measured_fp8_gemm": round(tflops / peak, 3),
              "separate_quantization_seconds": round(separate_seconds, 4),
              "fused_quantization_speedup": round(separate_seconds / seconds, 3),
              "note": "attention runs in bf16 (FlashInfer); its FLOPs count against the FP8 ceiling too",
              "goal": ">= 0.6"})


# ---- offline -----------------------------------------------------------------------------------


def bench_offline_pair(make_engine, rep: Reporter, prompts, out_lens, bench: str, runs, goal: str) -> None:
    """runs: ((name, engine kwargs) of the measured system, (name, kwargs) of its baseline)."""
    results = {}
    for name, kwargs in runs:
        engine = make_engine(**kwargs)
        results[name] = run_offline(engine, prompts, out_lens)
        free_engine(engine)
    (name, _), (base_name, _) = runs
    line = {"bench": bench, "requests": len(prompts), "system": name, **results[name],
            "baseline": f"{base_name}, same workload, measured in this run", "baseline_result": results[base_name],
            "speedup_vs_baseline": round(results[base_name]["seconds"] / results[name]["seconds"], 3), "goal": goal}
    if len(prompts) == 1000:
        line.update(vllm_fp8_recorded=VLLM_FP8_RECORDED,
                    ratio_vs_vllm_fp8_recorded=round(results[name]["output_tok_s"]
                                                     / VLLM_FP8_RECORDED["offline_output_tok_s"], 3))
    rep.emit(line)


# ---- a decode step of the offline workload's size ------------------------------------------------


def bench_decode_profile(make_engine, rep: Reporter, batch: int = 384, prompt_len: int = 1024,
                         steps: int = 16) -> None:
    """FP8 KV against bf16 KV (FP8 weights both) on decode steps of the offline workload's size
    (~350 running requests, ~1.1k tokens of context): `batch` prompts of `prompt_len` tokens are
    prefilled into the cache once, then each measured call extends each by one token and decodes
    `steps` more. Device ms per decode step, and the decode attention kernel's share and
    bandwidth from a profile of one call (whose kernel table the log shows)."""
    prompts = random_prompts(random.Random(3), [prompt_len] * batch)
    params = {"temperature": 0, "max_new_tokens": steps + 1, "ignore_eos": True}
    results = {}
    for name, kwargs in (("fp8 weights + bf16 KV", {}), ("fp8 weights + fp8_e4m3 KV", {"kv_cache_dtype": "fp8_e4m3"})):
        engine = make_engine(quantization="fp8", **kwargs)
        config = engine.model_config
        engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})  # the prompts' KV
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up at this batch
        timer = StepTimer(engine.scheduler.engine.runner)
        engine.generate(input_ids=prompts, sampling_params=params)
        device_s, step_count = timer.split()
        timer.remove()
        kernels = profile(lambda: engine.generate(input_ids=prompts, sampling_params=params),
                          f"{name}: {batch} requests x {steps + 1} tokens after {prompt_len} cached", rows=30)
        attention = next(k for k in kernels if k.key == "_decode_kernel")
        layer_us = attention.self_device_time_total / attention.count
        token_kv_bytes = 2 * config.num_kv_heads * config.head_dim * (1 if kwargs else 2)  # K and V, one layer
        layer_kv_bytes = batch * (prompt_len + 1 + steps / 2) * token_kv_bytes
        step_ms = device_s["decode"] / step_count["decode"] * 1e3
        results[name] = {"decode_ms_per_step": round(step_ms, 3),
                         "attention_us_per_layer": round(layer_us, 1),
                         "attention_tb_s": round(layer_kv_bytes / layer_us / 1e6, 3),
                         "attention_share_of_step": round(layer_us * config.num_layers / 1e3 / step_ms, 3)}
        free_engine(engine)
    fp8, bf16 = results["fp8 weights + fp8_e4m3 KV"], results["fp8 weights + bf16 KV"]
    rep.emit({"bench": "gpu_fp8_decode_step", "batch": batch, "cached_tokens": prompt_len, "decode_steps": steps,
              "system": "fp8 weights + fp8_e4m3 KV", **fp8,
              "baseline": "fp8 weights + bf16 KV, measured in this run", "baseline_result": bf16,
              "speedup_vs_baseline": round(bf16["decode_ms_per_step"] / fp8["decode_ms_per_step"], 3)})


# ---- accuracy on the real default model --------------------------------------------------------

_SUBJECTS = ["the moon", "photosynthesis", "the French revolution", "prime numbers", "a bicycle", "the ocean",
             "volcanoes", "the internet", "honey bees", "a violin", "gravity", "the Roman empire", "coffee",
             "black holes", "the human heart", "rainbows"]
_FORMS = ["Explain {} in one paragraph.", "Write a short poem about {}.", "List three facts about {}.",
          "What would a child ask about {}?"]


def accuracy_prompts(tokenizer, num: int = 64) -> list[list[int]]:
    """64 chat prompts (16 subjects x 4 forms) in the model's template."""
    texts = [form.format(subject) for form in _FORMS for subject in _SUBJECTS][:num]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def bench_accuracy(rep: Reporter, gguf: str, num: int = 64, new_tokens: int = 32) -> None:
    """On CUDA in bf16 (the engine's default there); on CPU in fp32."""
    from radixlm.srt import Engine

    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    base = Engine(gguf, max_total_tokens=65536)
    dtype = str(base.server_args.model.resolved_dtype()).removeprefix("torch.")
    prompts = accuracy_prompts(base.tokenizer, num)
    ref = base.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ref_ids = [o["output_ids"] for o in ref]
    ref_lp = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in ref]
    free_engine(base)
    engine = Engine(gguf, max_total_tokens=65536, quantization="fp8")
    got_ids = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.flush_cache()
    # The bf16 model's tokens scored by the FP8 model: prompt + continuation as input.
    scored = engine.generate(input_ids=[p + r for p, r in zip(prompts, ref_ids)],
                             sampling_params={"temperature": 0, "max_new_tokens": 1},
                             return_logprob=True, logprob_start_len=min(len(p) for p in prompts), top_logprobs_num=1)
    free_engine(engine)
    deltas, top1, prefix, exact = [], 0, [], 0
    for r_ids, r_lp, g_ids, s in zip(ref_ids, ref_lp, got_ids, scored):
        tail = s["meta_info"]["input_token_logprobs"][-len(r_ids):]
        tops = s["meta_info"]["input_top_logprobs"][-len(r_ids):]
        assert [t for _, t, _ in tail] == r_ids
        deltas += [abs(lp - ref) for (lp, _, _), ref in zip(tail, r_lp)]
        top1 += sum(top[0][1] == t for top, t in zip(tops, r_ids))
        same = next((i for i, (a, b) in enumerate(zip(r_ids, g_ids)) if a != b), len(r_ids))
        prefix.append(same / len(r_ids))
        exact += same == len(r_ids)
    total = sum(len(r) for r in ref_ids)
    rep.emit({"bench": "gpu_fp8_accuracy", "model": Path(gguf).name, "prompts": num, "new_tokens": new_tokens,
              "baseline": f"{dtype} weights, same model, measured in this run",
              "mean_abs_dlogprob": round(sum(deltas) / len(deltas), 4), "max_abs_dlogprob": round(max(deltas), 3),
              "top1_agreement_teacher_forced": round(top1 / total, 4),
              "greedy_prefix_agreement": round(sum(prefix) / len(prefix), 4), "greedy_exact_outputs": exact,
              "note": "top-1: the FP8 model's argmax after the bf16 model's prefix; prefix agreement: share of "
                      "each free-running output before its first differing token"})


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="decode,prefill", help=f"comma-separated, of {', '.join(SUITES)}")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--gguf", default=None, help="the default model's GGUF (accuracy suite)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--accuracy-prompts", type=int, default=64)
    parser.add_argument("--accuracy-tokens", type=int, default=32)
    parser.add_argument("--max-running-requests", type=int, default=512)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=512)
    parser.add_argument("--chunked-prefill-size", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page, for every engine of the run")
    args = parser.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    if "accuracy" in suites and not args.gguf:
        parser.error("the accuracy suite needs --gguf PATH (the default model's GGUF)")
    return args, suites


def main() -> None:
    args, suites = parse_args()
    rep = gpu_reporter(args.out)  # "device": "cpu" without a GPU (the accuracy suite runs there too)
    tokenizer = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)

    def make_engine(**overrides):
        from radixlm.srt import Engine

        settings = dict(max_running_requests=args.max_running_requests, cuda_graph_max_bs=args.cuda_graph_max_bs,
                        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.chunked_prefill_size,
                        page_size=args.page_size)
        settings.update(overrides)
        return Engine(str(LLAMA_8B_CONFIG), load_format="dummy", tokenizer_path=tokenizer, **settings)

    if "decode" in suites:
        bench_decode(make_engine, rep)
    if "prefill" in suites:
        bench_prefill(make_engine, rep)
    if "offline" in suites or "offline_kv" in suites:
        prompts, out_lens = offline_workload(num=args.num_requests)
        if "offline" in suites:
            bench_offline_pair(make_engine, rep, prompts, out_lens, "gpu_fp8_offline",
                               (("fp8 weights", {"quantization": "fp8"}), ("bf16 weights", {})), ">= 1.1x vLLM fp8")
        if "offline_kv" in suites:
            bench_offline_pair(make_engine, rep, prompts, out_lens, "gpu_fp8_offline_kv",
                               (("fp8 weights + fp8_e4m3 KV", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}),
                                ("fp8 weights + bf16 KV", {"quantization": "fp8"})), ">= 1.15x over bf16 KV")
    if "decode_profile" in suites:
        bench_decode_profile(make_engine, rep)
    if "accuracy" in suites:
        bench_accuracy(rep, args.gguf, args.accuracy_prompts, args.accuracy_tokens)


if __name__ == "__main__":
    main()
