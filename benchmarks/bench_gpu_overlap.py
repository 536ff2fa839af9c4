"""Can a large decode step hide its attention (memory-bound) behind FP8 GEMMs (compute-bound)
by running the two side by side on two streams? On one H200, Llama-3.1-8B shapes (32 layers,
FP8 weights with row-wise scales through torch._scaled_mm, our Triton decode attention over a
bf16 and an FP8 KV pool). Two ways, each against the same work run one kernel after another in
the same run (the baseline; ratio = baseline ms / variant ms, > 1 is faster):

  nano_batches      a decode batch of --batch requests x --kv-len cached tokens cut in two
                    halves (NanoFlow's idea): per layer [attention(A) || GEMMs(B)] then
                    [attention(B) || GEMMs(A)], against attention(all) then GEMMs(all). From
                    CUDA graphs, as decode steps run.
  beside_prefill    that decode batch's attention on one stream beside the four projections of
                    a --prefill-rows prefill batch on another (two batches in flight, 32 layers
                    each), against the same kernels on one stream; also with the attention (or
                    the GEMMs) held to some SMs by a CUDA green context (torch.cuda.green_contexts).

    python -m benchmarks.bench_gpu_overlap --out benchmarks/results/gpu_h200_fp8.jsonl
"""

from __future__ import annotations

import argparse
import time

import torch

from .gpu_measure import gpu_reporter, graph_replay_us
from .models import LLAMA_8B

HEADS, KV_HEADS, HEAD_DIM, LAYERS = LLAMA_8B.heads, LLAMA_8B.kv_heads, LLAMA_8B.head_dim, LLAMA_8B.layers
HIDDEN, INTER = LLAMA_8B.hidden, LLAMA_8B.intermediate
FP8 = torch.float8_e4m3fn
# (N, K) of qkv_proj, o_proj, gate_up_proj, down_proj
PROJECTIONS = tuple(LLAMA_8B.projections().values())


class Gemms:
    """The four FP8 projections of each layer, with quantized inputs of a few row counts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.weights = [[((torch.randn(n, k, device=device) * 0.05).to(FP8), torch.rand(1, n, device=device) + 0.5)
                         for n, k in PROJECTIONS] for _ in range(LAYERS)]
        self.inputs: dict[int, tuple[dict[int, torch.Tensor], torch.Tensor]] = {}

    def run(self, layer: int, rows: int) -> None:
        if rows not in self.inputs:
            self.inputs[rows] = ({k: torch.randn(rows, k, device=self.device).to(FP8) for k in (HIDDEN, INTER)},
                                 torch.rand(rows, 1, device=self.device))
        xs, x_scale = self.inputs[rows]
        for w, w_scale in self.weights[layer]:
            torch._scaled_mm(xs[w.shape[1]], w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)


class Attention:
    """A decode batch over LAYERS layers of a head-major pool (pages of 1, slots scattered), with
    page tables for the whole batch ("all") and for its two halves ("A", "B")."""

    def __init__(self, batch: int, kv_len: int, kv_dtype: torch.dtype, device: torch.device):
        slots = batch * kv_len
        bits = torch.uint8 if kv_dtype == FP8 else torch.int16
        self.pools = []
        for _ in range(LAYERS):
            k, v = (torch.empty(KV_HEADS, slots, HEAD_DIM, device=device, dtype=kv_dtype) for _ in range(2))
            k.view(bits).random_(0, 100)  # finite values in either dtype (e4m3 up to 48)
            v.view(bits).random_(0, 100)
            self.pools.append((k, v))
        order = torch.randperm(slots, device=device).to(torch.int32)
        half = batch // 2
        self.tables = {}
        for name, first, count in (("all", 0, batch), ("A", 0, half), ("B", half, batch - half)):
            self.tables[name] = (torch.randn(count, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
                                 torch.arange(count + 1, dtype=torch.int32, device=device) * kv_len,
                                 order[first * kv_len:(first + count) * kv_len].contiguous(),
                                 torch.ones(count, dtype=torch.int32, device=device))

    def run(self, layer: int, part: str) -> None:
        from radixlm.srt.executor.attention.triton_decode import paged_decode

        q, indptr, indices, last = self.tables[part]
        k, v = self.pools[layer]
        paged_decode(q, k, v, indptr, indices, last, 1, HEAD_DIM ** -0.5)


def side_by_side(first, second, stream_first: torch.cuda.Stream, stream_second: torch.cuda.Stream) -> None:
    """first() on one stream and second() on another, both after what the current stream queued,
    and the current stream waiting for both."""
    main = torch.cuda.current_stream()
    for stream, fn in ((stream_first, first), (stream_second, second)):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
    main.wait_stream(stream_first)
    main.wait_stream(stream_second)


def eager_ms(step, reps: int = 10) -> float:
    step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / reps


def graph_ms(step) -> float:
    """ms per step (all LAYERS layers) replayed from a CUDA graph."""
    return graph_replay_us(step) / 1e3


def green_stream(num_sms: int, keep: list) -> torch.cuda.Stream:
    """A stream whose kernels run on `num_sms` SMs only (the green context is kept alive in keep)."""
    from torch.cuda.green_contexts import GreenContext

    context = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    keep.append(context)
    return context.Stream()


def nano_batches(gemms: Gemms, attn: Attention, batch: int) -> dict:
    half = batch // 2
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def sequential():
        for layer in range(LAYERS):
            attn.run(layer, "all")
            gemms.run(layer, batch)

    def halves_one_stream():
        for layer in range(LAYERS):
            for part in "AB":
                attn.run(layer, part)
                gemms.run(layer, half)

    def halves_two_streams():
        for layer in range(LAYERS):
            for part in "AB":
                side_by_side(lambda: attn.run(layer, part), lambda: gemms.run(layer, half), s1, s2)

    base = graph_ms(sequential)
    line = {"sequential_ms": round(base, 3),
            "attention_ms": round(graph_ms(lambda: [attn.run(layer, "all") for layer in range(LAYERS)]), 3),
            "gemms_ms": round(graph_ms(lambda: [gemms.run(layer, batch) for layer in range(LAYERS)]), 3),
            "gemms_as_halves_ms": round(graph_ms(lambda: [gemms.run(layer, half) for layer in range(LAYERS)
                                                          for _ in "AB"]), 3),
            "halves_one_stream_ms": round(graph_ms(halves_one_stream), 3)}
    line["halves_two_streams_ms"] = round(graph_ms(halves_two_streams), 3)
    line["ratio"] = round(base / line["halves_two_streams_ms"], 3)
    return line


def beside_prefill(gemms: Gemms, attn: Attention, prefill_rows: int, sm_count: int) -> dict:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    keep: list = []

    def attention():
        for layer in range(LAYERS):
            attn.run(layer, "all")

    def prefill():
        for layer in range(LAYERS):
            gemms.run(layer, prefill_rows)

    base = eager_ms(lambda: (attention(), prefill()))
    line = {"sequential_ms": round(base, 3), "attention_ms": round(eager_ms(attention), 3),
            "prefill_gemms_ms": round(eager_ms(prefill), 3),
            "two_streams_ms": round(eager_ms(lambda: side_by_side(prefill, attention, s2, s1)), 3)}
    line["ratio"] = round(base / line["two_streams_ms"], 3)
    for attn_sms in (16, 33, 66):
        green = green_stream(attn_sms, keep)
        line[f"attention_on_{attn_sms}_sms_ms"] = round(eager_ms(lambda: side_by_side(prefill, attention, s2,
                                                                                        green)), 3)
        green = green_stream(sm_count - attn_sms, keep)
        line[f"gemms_on_{sm_count - attn_sms}_sms_ms"] = round(eager_ms(lambda: side_by_side(prefill, attention,
                                                                                              green, s1)), 3)
    best = min(v for k, v in line.items() if k.endswith("_sms_ms"))
    line["best_green_ratio"] = round(base / best, 3)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--prefill-rows", type=int, default=8192)
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    rep = gpu_reporter(args.out)
    common = {"batch": args.batch, "kv_len": args.kv_len,
              "baseline": "the same kernels on one stream, measured in this run"}
    gemms = Gemms(device)
    for kv_dtype in (torch.bfloat16, FP8):
        attn = Attention(args.batch, args.kv_len, kv_dtype, device)
        kv = "fp8_e4m3" if kv_dtype == FP8 else "bf16"
        rep.emit({"bench": "gpu_overlap_nano_batches", "kv": kv, **nano_batches(gemms, attn, args.batch), **common})
        rep.emit({"bench": "gpu_overlap_beside_prefill", "kv": kv, "prefill_rows": args.prefill_rows,
                  **beside_prefill(gemms, attn, args.prefill_rows, sm_count), **common})
        del attn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
