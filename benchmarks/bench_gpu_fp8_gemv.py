"""The few-row FP8 GEMM (srt/executor/quantization/fp8_gemv.py) on one H200, per Llama-3.1-8B
projection shape: achieved weight bandwidth against the paths it replaces, all measured here.

For each shape and row count (1, 8, 16) it times, from a CUDA graph that cycles through enough
copies of the weight that none stays in the 50 MB L2 (as in a real decode step, where each
weight is read once per step):
  bf16     cuBLAS bf16 GEMM on bf16 weights (what a bf16 model does)
  scaled   per-token activation quantization + torch._scaled_mm (the FP8 path for larger batches)
  gemv     fp8_gemv with the shipped `gemv_config`
  best     the fastest of a sweep of tile configurations (to tune `gemv_config`)
and prints one JSON line per (shape, rows) with GB/s, microseconds and the ratios. The `stack`
line times the 32 layers' four projections back to back at one row: the GEMM part of a batch-1
decode step, FP8 (shipped configs) vs bf16, against the bandwidth measured in the same run,
and FP8 with and without programmatic dependent launch (srt/executor/pdl.py).

    python -m benchmarks.bench_gpu_fp8_gemv [--sweep] --out benchmarks/results/gpu_h200_fp8.jsonl
"""

from __future__ import annotations

import argparse
import itertools

import torch

from .gpu_measure import gpu_reporter, graph_replay_us, measure_bandwidth
from .harness import Reporter
from .models import LLAMA_8B

SHAPES = LLAMA_8B.projections()
LAYERS = LLAMA_8B.layers
L2_BYTES = 50 * 2**20


def graph_time_us(calls, replays: int = 20) -> float:
    """Microseconds per call of `calls` (a list of thunks) captured into one CUDA graph."""
    def step() -> None:
        for fn in calls:
            fn()

    return graph_replay_us(step, replays) / len(calls)


def weights(n: int, k: int, copies: int):
    from radixlm.srt.executor.quantization.fp8 import quantize_weight

    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    fp8 = [quantize_weight(w) for w in bf16]
    return bf16, [(q, s.reshape(1, -1).contiguous()) for q, s in fp8]


def sweep_configs(rows: int, n: int, k: int):
    from radixlm.srt.executor.quantization.fp8_gemv import GemvConfig

    if rows == 1:  # the multiply-add kernel: small tiles, many programs
        tiles = ((4, 1024), (8, 512), (8, 1024), (8, 2048), (16, 256), (16, 512), (16, 1024), (16, 2048),
                 (32, 512))
        options = itertools.product(tiles, (1, 2), (4, 8), (1, 3))
    else:  # the tensor-core kernel
        tiles = ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256))
        options = itertools.product(tiles, (1, 2, 4, 8), (4, 8), (3, 5))
    for (block_n, block_k), split_k, warps, stages in options:
        if k % (split_k * block_k) == 0:
            yield GemvConfig(block_n, block_k, split_k, warps, stages)


def bench_shape(rep: Reporter, name: str, n: int, k: int, rows: int, sweep: bool) -> None:
    from radixlm.srt.executor.quantization.fp8 import quantize_per_token
    from radixlm.srt.executor.quantization.fp8_gemv import fp8_gemv, gemv_config, _sm_count

    copies = max(2, -(-3 * L2_BYTES // (n * k)))  # fp8 copies spanning 3x the L2
    bf16, fp8 = weights(n, k, copies)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def scaled(q, s):
        xq, xs = quantize_per_token(x)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16)

    us = {"bf16": graph_time_us([lambda w=w: x @ w.t() for w in bf16]),
          "scaled": graph_time_us([lambda q=q, s=s: scaled(q, s) for q, s in fp8]),
          "gemv": graph_time_us([lambda q=q, s=s: fp8_gemv(x, q, s, torch.bfloat16) for q, s in fp8])}
    shipped = gemv_config(rows, n, k, _sm_count(0))
    line = {"bench": "gpu_fp8_gemv", "projection": name, "n": n, "k": k, "rows": rows,
            "gemv_us": round(us["gemv"], 2), "gemv_gb_s": round(n * k / us["gemv"] / 1e3, 1),
            "baseline": "cuBLAS bf16 GEMM on bf16 weights, measured in this run (L2 cold: cycling weight copies)",
            "bf16_us": round(us["bf16"], 2), "bf16_gb_s": round(2 * n * k / us["bf16"] / 1e3, 1),
            "scaled_mm_us": round(us["scaled"], 2), "speedup_vs_bf16": round(us["bf16"] / us["gemv"], 3),
            "speedup_vs_scaled_mm": round(us["scaled"] / us["gemv"], 3), "shipped_config": shipped.__dict__}
    if sweep and rows in (1, 8):  # one row: the multiply-add kernel; more: the tensor-core one
        results = []
        for config in sweep_configs(rows, n, k):
            try:
                t = graph_time_us([lambda q=q, s=s: fp8_gemv(x, q, s, torch.bfloat16, config) for q, s in fp8],
                                  replays=10)
            except Exception as e:  # a tile that does not fit shared memory: skip it
                print(f"# {name} rows={rows} {config}: {type(e).__name__}", flush=True)
                continue
            results.append((t, config))
        results.sort(key=lambda r: r[0])
        line["best_us"] = round(results[0][0], 2)
        line["best_gb_s"] = round(n * k / results[0][0] / 1e3, 1)
        line["best_configs"] = [{"us": round(t, 2), **c.__dict__} for t, c in results[:5]]
    rep.emit(line)


def bench_stack(rep: Reporter, bw: dict) -> None:
    """Batch-1: every layer's four projections (distinct weights, as in the model), FP8 via
    fp8_gemv vs bf16 cuBLAS, against the bandwidth roofline of those bytes."""
    from radixlm.srt.executor.quantization.fp8_gemv import fp8_gemv

    x = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 14336)}
    fp8_bytes = LAYERS * sum(n * k for n, k in SHAPES.values())
    layers_fp8 = [[(weights(n, k, 1)[1][0], k) for n, k in SHAPES.values()] for _ in range(LAYERS)]
    def stack(pdl: bool) -> list:
        return [lambda q=q, k=k: fp8_gemv(x[k], q[0], q[1], torch.bfloat16, pdl=pdl)
                for layer in layers_fp8 for q, k in layer]

    fp8_us = graph_time_us(stack(True), replays=10) * 4 * LAYERS
    fp8_no_pdl_us = graph_time_us(stack(False), replays=10) * 4 * LAYERS  # launched plainly (pdl.py)
    layers_fp8 = None
    torch.cuda.empty_cache()
    layers_bf16 = [[(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), k) for n, k in SHAPES.values()]
                   for _ in range(LAYERS)]
    bf16_us = graph_time_us([lambda w=w, k=k: x[k] @ w.t() for layer in layers_bf16 for w, k in layer],
                            replays=10) * 4 * LAYERS
    layers_bf16 = None
    torch.cuda.empty_cache()
    best_bw = max(bw.values()) * 1e12
    rep.emit({"bench": "gpu_fp8_gemv_stack", "rows": 1, "layers": LAYERS, "fp8_ms": round(fp8_us / 1e3, 3),
              "fp8_weight_gb": round(fp8_bytes / 1e9, 3), "fp8_without_pdl_ms": round(fp8_no_pdl_us / 1e3, 3),
              "pdl_speedup": round(fp8_no_pdl_us / fp8_us, 3),
              "fp8_fraction_of_roofline": round(fp8_bytes / best_bw * 1e6 / fp8_us, 3),
              "baseline": "the same projections in bf16 through cuBLAS, measured in this run",
              "bf16_ms": round(bf16_us / 1e3, 3),
              "bf16_fraction_of_roofline": round(2 * fp8_bytes / best_bw * 1e6 / bf16_us, 3),
              "speedup_vs_bf16": round(bf16_us / fp8_us, 3), "bandwidth_tb_s": {k: round(v, 3) for k, v in bw.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--sweep", action="store_true", help="also time a sweep of tile configurations at 1 and 8 rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rep = gpu_reporter(args.out)
    torch.manual_seed(0)
    bw = measure_bandwidth()
    for rows in (int(r) for r in args.rows.split(",") if r):
        for name, (n, k) in SHAPES.items():
            bench_shape(rep, name, n, k, rows, args.sweep)
    bench_stack(rep, bw)


if __name__ == "__main__":
    main()
