"""GPU benchmarks of the model families beyond Llama (bf16, dummy weights). Prints one JSON line
per result and appends them to --out; each line names the baseline it was measured against in
the same run.

  mixtral_decode   Mixtral-8x7B shape, batch-1 decode ms/token vs its active-weight roofline:
                   the bytes one token must read (attention, router and 2 of 8 experts per layer,
                   final norm and LM head) over the HBM bandwidth measured here; goal >= 70%
  mixtral_offline  Mixtral-8x7B shape, the offline workload (input U[512,1536], output
                   U[128,384], ignore_eos): output tok/s; baseline HF `generate` on the first
                   --hf-requests requests (run first, in the same process, then freed)
  gemma2_offline   Gemma-2-9B shape (sliding window 4096 on every other layer, soft-capping),
                   the same workload and baseline (HF runs Gemma 2 with eager attention: its
                   SDPA path cannot soft-cap)

Run on the H200 (see README, "GPU"):
  python -m benchmarks.bench_gpu_models --suites mixtral_decode,mixtral_offline \
      --out benchmarks/results/gpu_h200_models.jsonl
  python -m benchmarks.bench_gpu_models --suites gemma2_offline --out benchmarks/results/gpu_h200_models.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

import torch

from .engine_runs import decode_ms_per_token, offline_seconds
from .gpu_measure import gpu_reporter, measure_bandwidth
from .gpu_workloads import offline_workload, random_prompts
from .harness import timed
from .hf_baseline import hf_generate_seconds
from .models import LLAMA3_TOKENIZER_GGUF

SHAPES = {
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
        "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 256000, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    },
}


def write_config(name: str, folder: Path) -> Path:
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(SHAPES[name]))
    return path


def active_weight_bytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Weight bytes one decode token reads: every non-expert matrix (the embedding only one
    row), and num_experts_per_tok experts in each sparse layer."""
    from radixlm.srt.executor.model_loader import weight_shapes

    total = 0
    for name, shape in weight_shapes(config).items():
        numel = math.prod(shape)
        if name == "model.embed_tokens.weight":
            numel = shape[1] * (1 if not config.tie_word_embeddings else shape[0])  # tied: it is the LM head
        elif ".experts." in name:
            numel = numel * config.num_experts_per_tok / config.num_experts
        total += numel
    return int(total * dtype.itemsize)


def ordinary_ids(vocab: int) -> tuple[int, int]:
    """The id range prompts draw from: the vocabulary without its first and last 100 (special) ids."""
    return 100, vocab - 100


def run_hf_baseline(rep, name: str, config_path: Path, prompts, out_lens, num: int) -> float:
    """HF `generate` (bf16, random weights) on the first `num` requests, one left-padded batch."""
    from transformers import AutoConfig

    attn = "eager" if AutoConfig.from_pretrained(str(config_path.parent)).model_type == "gemma2" else "sdpa"
    prompts, out_lens = prompts[:num], out_lens[:num]
    seconds = hf_generate_seconds(config_path.parent, prompts, out_lens, attn)
    rep.emit({"bench": f"gpu_offline_hf_baseline_{name}", "system": "hf_transformers_generate", "attention": attn,
              "requests": num, "seconds": round(seconds, 2), "output_tok_s": round(sum(out_lens) / seconds, 1)})
    return sum(out_lens) / seconds


def bench_decode(engine, rep, name: str, bw: dict) -> None:
    prompt = random_prompts(random.Random(1), [128], ordinary_ids(engine.model_config.vocab_size))[0]
    ms = decode_ms_per_token(engine, prompt)
    active = active_weight_bytes(engine.model_config)
    roofline_ms = active / (max(bw.values()) * 1e12) * 1e3
    rep.emit({"bench": f"gpu_decode_bs1_{name}", "prompt_tokens": 128, "ms_per_token": round(ms, 3),
              "tok_s": round(1e3 / ms, 1), "baseline": "roofline active_weight_bytes/measured_bandwidth",
              "active_weight_gb": round(active / 1e9, 3), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()},
              "roofline_ms": round(roofline_ms, 3), "fraction_of_roofline": round(roofline_ms / ms, 3),
              "goal": ">= 0.7"})


def bench_offline(engine, rep, name: str, prompts, out_lens, hf_tok_s: float | None, hf_requests: int) -> None:
    def run(n):
        return offline_seconds(engine, prompts[:n], out_lens[:n])

    run(16)  # warm-up
    for n in sorted({n for n in (hf_requests, len(prompts)) if n}):
        seconds = run(n)
        out_tokens, in_tokens = sum(out_lens[:n]), sum(len(p) for p in prompts[:n])
        line = {"bench": f"gpu_offline_{name}", "system": "radixlm_engine", "requests": n,
                "seconds": round(seconds, 2), "output_tok_s": round(out_tokens / seconds, 1),
                "total_tok_s": round((out_tokens + in_tokens) / seconds, 1)}
        if hf_tok_s:
            line.update(baseline=f"hf_transformers_generate first {hf_requests} requests",
                        ratio_vs_hf=round(out_tokens / seconds / hf_tok_s, 2))
        rep.emit(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="mixtral_decode,mixtral_offline")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--hf-requests", type=int, default=32, help="requests HF generate runs (0: no baseline)")
    parser.add_argument("--max-running-requests", type=int, default=512)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    args = parser.parse_args()
    suites = set(args.suites.split(","))
    unknown = suites - {"mixtral_decode", "mixtral_offline", "gemma2_offline"}
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}")
    rep = gpu_reporter(args.out)
    tokenizer = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)
    folder = Path(tempfile.mkdtemp(prefix="radixlm-bench-models-"))

    from radixlm.srt import Engine

    for name, model_suites in (("mixtral-8x7b", {"mixtral_decode", "mixtral_offline"}),
                               ("gemma-2-9b", {"gemma2_offline"})):
        wanted = suites & model_suites
        if not wanted:
            continue
        config_path = write_config(name, folder)
        vocab = SHAPES[name]["vocab_size"]
        prompts, out_lens = offline_workload(num=args.num_requests, ids=ordinary_ids(vocab))
        offline = any(s.endswith("offline") for s in wanted)
        hf_tok_s = (run_hf_baseline(rep, name, config_path, prompts, out_lens, args.hf_requests)
                    if offline and args.hf_requests else None)
        bw = measure_bandwidth() if "mixtral_decode" in wanted else None
        torch.cuda.synchronize()
        engine, ready_s = timed(Engine, str(config_path), load_format="dummy", tokenizer_path=tokenizer,
                                max_running_requests=args.max_running_requests,
                                cuda_graph_max_bs=min(512, args.max_running_requests),
                                chunked_prefill_size=args.chunked_prefill_size,
                                max_prefill_tokens=args.chunked_prefill_size,
                                disable_cuda_graph=args.disable_cuda_graph)
        rep.emit({"bench": f"gpu_engine_ready_{name}", "seconds": round(ready_s, 1),
                  "kv_tokens": engine.scheduler.allocator.capacity,
                  "note": "in-process Engine (dummy weights, CUDA graphs), without interpreter/import time"})
        if "mixtral_decode" in wanted:
            bench_decode(engine, rep, name, bw)
        if offline:
            bench_offline(engine, rep, name, prompts, out_lens, hf_tok_s, args.hf_requests)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
