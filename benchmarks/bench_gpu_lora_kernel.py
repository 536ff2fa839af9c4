"""The LoRA kernels (srt/lora/triton_lora.py) against their memory roofline and against the
torch path's masked products (the baseline, timed in the same run), per projection of the
Llama-3.1-8B shape with 8 adapters of rank 16 in the slots, the tokens' adapters uniform.

Bytes counted: the activations read, each distinct adapter's A and B read once, the output read
and written (the base GEMM's output is updated in place). The roofline divides them by the HBM
read bandwidth measured in the same run (gpu_measure.measure_bandwidth).

    python -m benchmarks.bench_gpu_lora_kernel [--out FILE]
    TRITON_INTERPRET=1 python -m benchmarks.bench_gpu_lora_kernel --tiny   # checks the script on CPU
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
from torch import nn

from .gpu_measure import device_name, gpu_reporter, graph_replay_us, measure_bandwidth
from .harness import best_seconds, ratio
from .models import LLAMA_8B

BATCHES = (1, 64, 256)


def projections(tiny: bool) -> dict[str, tuple[int, dict[str, int]]]:
    """name -> (fan in, {part: fan out})."""
    if tiny:
        return {"qkv_proj": (64, {"q_proj": 64, "k_proj": 32, "v_proj": 32}), "down_proj": (96, {"down_proj": 64})}
    s = LLAMA_8B
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv_proj": (s.hidden, {"q_proj": q, "k_proj": kv, "v_proj": kv}), "o_proj": (q, {"o_proj": s.hidden}),
            "gate_up_proj": (s.hidden, {"gate_proj": s.intermediate, "up_proj": s.intermediate}),
            "down_proj": (s.intermediate, {"down_proj": s.hidden})}


class Given(nn.Module):
    """A projection whose output is a given tensor (LoRA adds into it in place)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="small shapes on any device: checks the script")
    parser.add_argument("--repeats", type=int, default=50, help="CUDA: graph replays averaged; CPU: runs, the best kept")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()

    from radixlm.srt.lora.layers import BatchAdapters, LoRALinear

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    frame = {"date": datetime.date.today().isoformat(), "machine": f"{device_name()}, {os.cpu_count()} CPU cores"}
    report = gpu_reporter(args.out)
    # The ceiling, measured here (none on CPU: --tiny only checks the script).
    read_bytes_per_s = measure_bandwidth()["read_tb_s"] * 1e12 if cuda else None
    # On CUDA each variant is timed as the engine runs it, replayed from a CUDA graph (a Python
    # call's launch overhead, ~100 us for three Triton launches, would hide the kernels).
    seconds = (lambda fn: graph_replay_us(fn, args.repeats) / 1e6) if cuda else \
        (lambda fn: best_seconds(fn, args.repeats))
    slots, rank = 8, 16
    batches = (1, 4) if args.tiny else BATCHES
    gen = torch.Generator(device="cpu").manual_seed(0)
    for proj, (fan_in, outs) in projections(args.tiny).items():
        shapes = {part: (fan_in, n) for part, n in outs.items()}
        batch = BatchAdapters(slots, rank, device, dtype)
        base = nn.Linear(fan_in, sum(outs.values()), bias=False, device=device, dtype=dtype)
        lora = LoRALinear(base, tuple(outs), shapes, batch)
        for s in range(slots):
            lora.write_slot(s, {p: (torch.randn(rank, fan_in, generator=gen) * 0.02,
                                    torch.randn(n, rank, generator=gen) * 0.02) for p, n in outs.items()})
            batch.set_scaling(s, 2.0, rank)
        for tokens in batches:
            x = torch.randn(tokens, fan_in, generator=gen).to(device, dtype)
            out = torch.randn(tokens, sum(outs.values()), generator=gen).to(device, dtype)
            token_slots = [t % slots for t in range(tokens)]
            batch.prepare(token_slots)
            lora.base = Given(out)  # the products alone: the base GEMM's output is given
            figures = {}
            for backend in ("torch", "triton"):
                batch.triton_max_tokens = tokens if backend == "triton" else 0
                figures[backend] = seconds(lambda: lora(x))
            lora.base = base
            if tokens == 1 and cuda:  # the projection as the engine runs it: GEMM, then the kernels
                batch.triton_max_tokens = tokens
                chain = {"base_gemm_us": seconds(lambda: base(x))}
                for pdl in (False, True):
                    batch.pdl = pdl
                    chain[f"gemm_and_lora_pdl_{'on' if pdl else 'off'}_us"] = seconds(lambda: lora(x))
                chain = {k: round(v * 1e6, 2) for k, v in chain.items()}
                lora_only = {f"lora_us_pdl_{s}": round(chain[f"gemm_and_lora_pdl_{s}_us"] - chain["base_gemm_us"], 2)
                             for s in ("off", "on")}
                report.emit({"bench": "gpu_lora_kernel", "projection": proj, "tokens": 1,
                             "what": "base GEMM + LoRA kernels, one CUDA graph", **chain, **lora_only, **frame})
            used = min(tokens, slots)
            elem = torch.finfo(dtype).bits // 8
            moved = (tokens * fan_in + used * rank * (len(outs) * fan_in + sum(outs.values()))
                     + 2 * tokens * sum(outs.values())) * elem
            roofline = moved / read_bytes_per_s if read_bytes_per_s else None
            report.emit({"bench": "gpu_lora_kernel", "projection": proj, "tokens": tokens,
                         "adapters": f"{slots} slots of rank {rank}, {used} used", "dtype": str(dtype),
                         "triton_us": round(figures["triton"] * 1e6, 2), "torch_us": round(figures["torch"] * 1e6, 2),
                         "vs": "the torch path's masked products on the same inputs, this run",
                         "speedup_vs_torch": ratio(figures["torch"], figures["triton"]),
                         "bytes": moved, "roofline_us": round(roofline * 1e6, 2) if roofline else None,
                         "fraction_of_roofline": ratio(roofline, figures["triton"]) if roofline else None,
                         "ceiling": "HBM read bandwidth measured in this run", **frame})


if __name__ == "__main__":
    main()
