"""The batch-invariant GEMM (srt/executor/batch_invariant_gemm.py, the projections and LM head of
--enable-deterministic-inference on CUDA) against cuBLAS (torch's F.linear, the engine's GEMM
without the flag: the baseline, timed in the same run), per projection of the Llama-3.1-8B
shape and row count, bf16.

Each line gives microseconds per call of cuBLAS and of each launch configuration (`--tiles`,
besides the one the kernel picks for the row count), their ratio to cuBLAS (> 1 is faster), and
whether each configuration's output has the same bits as REFERENCE_TILES' output: a tile's
size must not change a row's sums (the module docstring says why it does not). "invariant" is
what the engine calls (invariant_linear_cuda: cuBLAS where proven to give the Triton kernel's
bits, else the kernel), and same_bits["cublas"] says whether plain cuBLAS matched.

--cublas-bits instead checks, per shape, at which row counts (every count to 256, then every
16th to --max-rows) cuBLAS gives a row the Triton kernel's bits, and times the three at a few.

    python -m benchmarks.bench_gpu_invariant_gemm [--rows 1,64,512,4096] [--tiles 128x128x64w8s4] [--out FILE]
    python -m benchmarks.bench_gpu_invariant_gemm --cublas-bits [--max-rows 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F

from .gpu_measure import device_name, gpu_reporter
from .harness import ratio
from .models import LLAMA_8B, LLAMA_8B_CONFIG

ROWS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
REFERENCE_TILES = "64x128x64w4s4"


def shapes() -> dict[str, tuple[int, int]]:
    """name -> (fan in, fan out) of the 8B shape's GEMMs."""
    s = LLAMA_8B
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    vocab = json.loads(LLAMA_8B_CONFIG.read_text())["vocab_size"]
    return {"qkv_proj": (s.hidden, q + 2 * kv), "o_proj": (q, s.hidden), "gate_up_proj": (s.hidden, 2 * s.intermediate),
            "down_proj": (s.intermediate, s.hidden), "lm_head": (s.hidden, vocab)}


def parse_tiles(text: str):
    """'128x128x64w8s3' -> Tiles(128, 128, 64, 8, 3)."""
    from radixlm.srt.executor.batch_invariant_gemm import Tiles

    dims, rest = text.split("w")
    warps, stages = rest.split("s")
    return Tiles(*(int(d) for d in dims.split("x")), int(warps), int(stages))


def tiles_name(t) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"


def microseconds(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def _spans(counts: list[int]) -> str:
    """[1, 2, 3, 16, 32] -> '1-32' when at most 16 apart, as the sweep's step."""
    spans: list[list[int]] = []
    for m in counts:
        if spans and m - spans[-1][1] <= 16:
            spans[-1][1] = m
        else:
            spans.append([m, m])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def cublas_bits(names: list[str], max_rows: int, report, frame: dict) -> None:
    from radixlm.srt.executor import batch_invariant_gemm as gemm

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def kernel(x, w):
        return gemm.invariant_linear_cuda(x, w, tiles=gemm.tiles_for(x.shape[0], w.shape[0], sms))

    torch.manual_seed(0)
    counts = list(range(1, 257)) + list(range(272, max_rows + 1, 16))
    for name in names:
        fan_in, fan_out = shapes()[name]
        w = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) / 64
        x = torch.randn(max_rows, fan_in, device="cuda", dtype=torch.bfloat16)
        reference = kernel(x, w)
        same, differ, kernel_varies = [], [], []
        for m in counts:
            ours = kernel(x[:m], w)
            kernel_varies += [] if torch.equal(ours, reference[:m]) else [m]
            (same if torch.equal(F.linear(x[:m], w), ours) else differ).append(m)
        us = {}
        for m in (1, 64, 256, 1024, 4096, max_rows):
            xs = x[:m]
            us[m] = {"cublas": microseconds(lambda: F.linear(xs, w)), "kernel": microseconds(lambda: kernel(xs, w)),
                     "invariant": microseconds(lambda: gemm.invariant_linear_cuda(xs, w))}
        report.emit({"bench": "gpu_invariant_gemm_cublas_bits", "shape": name, "fan_in": fan_in, "fan_out": fan_out,
                     "rows_checked": f"1-256, then every 16th to {max_rows}", "cublas_same_bits_rows": _spans(same),
                     "cublas_other_bits_rows": _spans(differ), "kernel_varies_rows": _spans(kernel_varies),
                     "us": {m: {k: round(v, 1) for k, v in t.items()} for m, t in us.items()},
                     "invariant_vs_cublas": {m: ratio(t["cublas"], t["invariant"]) for m, t in us.items()},
                     "kernel_vs_cublas": {m: ratio(t["cublas"], t["kernel"]) for m, t in us.items()},
                     "baseline": "cublas (F.linear), measured in this run", **frame})
        del w, x, reference
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(shapes()), help="of " + ", ".join(shapes()))
    parser.add_argument("--tiles", default="", help="more launch configurations, comma-separated")
    parser.add_argument("--cublas-bits", action="store_true", help="where cuBLAS gives the kernel's bits (above)")
    parser.add_argument("--max-rows", type=int, default=8192, help="--cublas-bits: the largest row count checked")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()

    from radixlm.srt.executor import batch_invariant_gemm as gemm

    report = gpu_reporter(args.out)
    extra = [parse_tiles(t) for t in args.tiles.split(",") if t]
    frame = {"date": datetime.date.today().isoformat(), "machine": f"{device_name()}, one GPU"}
    if args.cublas_bits:
        cublas_bits(args.shapes.split(","), args.max_rows, report, frame)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        fan_in, fan_out = shapes()[name]
        w = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) / 64
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, fan_in, device="cuda", dtype=torch.bfloat16)
            picked = gemm.tiles_for(m, fan_out, sms)
            configs = {"picked": picked, **{tiles_name(t): t for t in extra if t != picked}}
            us = {"cublas": microseconds(lambda: F.linear(x, w)),
                  "invariant": microseconds(lambda: gemm.invariant_linear_cuda(x, w))}
            reference = gemm.invariant_linear_cuda(x, w, tiles=parse_tiles(REFERENCE_TILES))
            same_bits = {"cublas": torch.equal(F.linear(x, w), reference),
                         "invariant": torch.equal(gemm.invariant_linear_cuda(x, w), reference)}
            for label, tiles in configs.items():
                us[label] = microseconds(lambda: gemm.invariant_linear_cuda(x, w, tiles=tiles))
                same_bits[label] = torch.equal(gemm.invariant_linear_cuda(x, w, tiles=tiles), reference)
            flops = 2 * m * fan_in * fan_out
            report.emit({"bench": "gpu_invariant_gemm", "shape": name, "fan_in": fan_in, "fan_out": fan_out, "rows": m,
                         "picked": tiles_name(picked), "us": {k: round(v, 2) for k, v in us.items()},
                         "tflops": {k: round(flops / v / 1e6, 1) for k, v in us.items()},
                         "baseline": "cublas (F.linear), measured in this run",
                         "speedup_vs_cublas": {k: ratio(us["cublas"], v) for k, v in us.items() if k != "cublas"},
                         "same_bits_as": REFERENCE_TILES, "same_bits": same_bits, **frame})
            del x, reference
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
