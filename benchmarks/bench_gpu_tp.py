"""Tensor parallelism on a two-GPU H200 machine (bf16, dummy weights). JSON lines, each with its
baseline measured in the same run; vLLM's figures are recorded ones, labelled so.

  8b    Llama-3.1-8B shape: TP=1 then TP=2: batch-1 decode ms/token (goal: TP=2 <= 0.6x TP=1)
        and the offline workload (gpu_workloads.py: input U[512,1536], output U[128,384])
  70b   Llama-3.1-70B shape (hidden 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672, vocab
        128256) on TP=2 (it does not fit one H200): batch-1 decode against the two-GPU bandwidth
        roofline, weight bytes / (2 x one GPU's bandwidth measured here) (goal >= 0.88), and
        400 offline requests. vLLM 0.24.0 TP=2 on the same machine kind, 2026-11-30, dummy
        weights (recorded, not run here): 19.84 ms/token, 400 requests in 76.6 s, 1343 output tok/s.

  python -m benchmarks.bench_gpu_tp --suites 8b --out benchmarks/results/gpu_h200x2_tp.jsonl
  python -m benchmarks.bench_gpu_tp --suites 70b --out benchmarks/results/gpu_h200x2_tp.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from .engine_runs import decode_ms_per_token, free_engine, offline_seconds
from .gpu_measure import gpu_reporter, measure_bandwidth
from .gpu_workloads import offline_workload, random_prompts
from .harness import Reporter, timed
from .models import LLAMA3_TOKENIZER_GGUF, LLAMA_8B_CONFIG

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
             "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
VLLM_70B_TP2_RECORDED = {"decode_ms_per_token": 19.84, "offline_400_seconds": 76.6, "offline_400_output_tok_s": 1343.0,
                "date": "2026-11-30", "version": "0.24.0", "machine": "2x NVIDIA H200 (this project's GPU machine)",
                "settings": "tensor_parallel_size=2, dummy weights, bf16", "measured_in_this_run": False}


def warm_offline_seconds(engine, prompts, out_lens) -> float:
    """The offline workload's seconds, after a 16-request warm-up."""
    offline_seconds(engine, prompts[:16], out_lens[:16])
    return offline_seconds(engine, prompts, out_lens)


def decode_ms(engine) -> float:
    return decode_ms_per_token(engine, random_prompts(random.Random(1), [128])[0])


def make_engine(config_path: str, tokenizer: str, tp: int, **kw):
    from radixlm.srt import Engine

    return Engine(config_path, load_format="dummy", tokenizer_path=tokenizer, tp_size=tp, max_running_requests=512,
                  chunked_prefill_size=16384, max_prefill_tokens=16384, **kw)


def bench_8b(rep: Reporter, tokenizer: str, num_requests: int, offline: bool = True,
             all_reduce: str = "nccl") -> None:
    prompts, out_lens = offline_workload(num=num_requests)
    out_tokens = sum(out_lens)
    results = {}
    for tp in (1, 2):
        engine, ready = timed(make_engine, str(LLAMA_8B_CONFIG), tokenizer, tp, tp_all_reduce=all_reduce)
        results[tp] = {"decode_ms": decode_ms(engine), "ready_s": ready,
                       "offline_s": warm_offline_seconds(engine, prompts, out_lens) if offline else None}
        free_engine(engine)
    one, two = results[1], results[2]
    rep.emit({"bench": "gpu_tp_decode_bs1", "model": "llama-3.1-8b shape", "tp": 2,
              "ms_per_token": round(two["decode_ms"], 3), "baseline": "tp=1 in this run",
              "baseline_ms_per_token": round(one["decode_ms"], 3),
              "ratio_tp2_over_tp1": round(two["decode_ms"] / one["decode_ms"], 3), "goal": "<= 0.6",
              "all_reduce": all_reduce})
    if not offline:
        return
    rep.emit({"bench": "gpu_tp_offline", "model": "llama-3.1-8b shape", "tp": 2, "requests": num_requests,
              "seconds": round(two["offline_s"], 2), "output_tok_s": round(out_tokens / two["offline_s"], 1),
              "baseline": "tp=1 in this run", "baseline_seconds": round(one["offline_s"], 2),
              "speedup_vs_tp1": round(one["offline_s"] / two["offline_s"], 3),
              "engine_ready_s": {"tp1": round(one["ready_s"], 1), "tp2": round(two["ready_s"], 1)}})


def bench_70b(rep: Reporter, tokenizer: str, num_requests: int, workdir: Path, all_reduce: str = "nccl") -> None:
    from radixlm.srt.executor.model_runner import model_bytes

    bw = measure_bandwidth()  # one GPU's; the two GPUs read their halves at once
    config_path = workdir / "llama-3.1-70b.json"
    config_path.write_text(json.dumps(LLAMA_70B))
    engine, ready = timed(make_engine, str(config_path), tokenizer, 2, tp_all_reduce=all_reduce)
    weight_bytes = model_bytes(engine.model_config, torch.bfloat16)
    ms = decode_ms(engine)
    best_bw = max(bw["read_tb_s"], bw["copy_tb_s"]) * 1e12
    roofline_ms = weight_bytes / (2 * best_bw) * 1e3
    rep.emit({"bench": "gpu_tp_decode_bs1", "model": "llama-3.1-70b shape", "tp": 2, "ms_per_token": round(ms, 3),
              "baseline": "roofline weight_bytes / (2 x one GPU's bandwidth measured here)",
              "weight_gb": round(weight_bytes / 1e9, 2), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()},
              "roofline_ms": round(roofline_ms, 3), "fraction_of_roofline": round(roofline_ms / ms, 3),
              "goal": ">= 0.88", "engine_ready_s": round(ready, 1), "vllm_recorded": VLLM_70B_TP2_RECORDED,
              "all_reduce": all_reduce,
              "ratio_vs_vllm_recorded": round(VLLM_70B_TP2_RECORDED["decode_ms_per_token"] / ms, 3)})
    prompts, out_lens = offline_workload(num=num_requests)
    seconds = warm_offline_seconds(engine, prompts, out_lens)
    tok_s = sum(out_lens) / seconds
    rep.emit({"bench": "gpu_tp_offline", "model": "llama-3.1-70b shape", "tp": 2, "requests": num_requests,
              "seconds": round(seconds, 2), "output_tok_s": round(tok_s, 1), "vllm_recorded": VLLM_70B_TP2_RECORDED,
              "ratio_vs_vllm_recorded": round(tok_s / VLLM_70B_TP2_RECORDED["offline_400_output_tok_s"], 3),
              "note": "no in-run baseline: the 70B shape does not fit one GPU; vLLM's figure is recorded"})
    free_engine(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="8b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--num-requests", type=int, default=None, help="offline requests (8b: 1000, 70b: 400)")
    parser.add_argument("--tp-all-reduce", default="nccl", choices=("nccl", "one_shot"), help="the engines' all-reduce")
    args = parser.parse_args()
    suites = set(args.suites.split(","))
    rep = gpu_reporter(args.out)
    tokenizer = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_gpu_tp needs two GPUs")
    if "8b" in suites or "8b_decode" in suites:
        bench_8b(rep, tokenizer, args.num_requests or 1000, offline="8b" in suites, all_reduce=args.tp_all_reduce)
    if "70b" in suites:
        with tempfile.TemporaryDirectory() as workdir:
            bench_70b(rep, tokenizer, args.num_requests or 400, Path(workdir), all_reduce=args.tp_all_reduce)


if __name__ == "__main__":
    main()
