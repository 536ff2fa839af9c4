"""FlashInfer decode attention variants on one H200, Llama-3.1-8B attention shape (32 query heads,
8 KV heads, head_dim 128, bf16 queries, bf16 or FP8 KV, pages of 1 or more): microseconds per layer, 32 layers with their own KV
replayed from one CUDA graph, as a decode step runs them. The baseline is FlashInfer's
tensor-core decode (split-KV as FlashInfer plans it), measured in the same run; `triton` is
the engine's own kernel for FP8 pools (srt/executor/attention/fp8_decode.py), also timed over
bf16 pools.

    python benchmarks/bench_gpu_decode_attention.py --out benchmarks/results/gpu_h200.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_llama8b import Reporter  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32
VARIANTS = {"tensor_cores": (True, False), "tensor_cores_no_split": (True, True), "cuda_cores": (False, False),
            "cuda_cores_no_split": (False, True)}


def layer_us(batch: int, kv_len: int, variant: str, kv_dtype: torch.dtype, tiles=(128, 4, 3),
             page_size: int = 1) -> float:
    device = torch.device("cuda")
    pages_per_req = -(-kv_len // page_size)
    pages = batch * pages_per_req
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per_req
    indices = torch.randperm(pages, device=device).to(torch.int32)  # scattered pages, as a busy pool has
    last = torch.full((batch,), kv_len - (pages_per_req - 1) * page_size, dtype=torch.int32, device=device)
    if variant == "triton":  # the engine's kernel for FP8 pools (head-major pool, as KVPool holds it)
        from radixlm.srt.executor.attention.fp8_decode import fp8_paged_decode

        slots = pages * page_size
        pools = [(torch.randn(KV_HEADS, slots, HEAD_DIM, device=device).to(kv_dtype),
                  torch.randn(KV_HEADS, slots, HEAD_DIM, device=device).to(kv_dtype)) for _ in range(LAYERS)]

        def step():
            for k, v in pools:
                fp8_paged_decode(q, k, v, indptr, indices, last, page_size, HEAD_DIM ** -0.5, tiles=tiles)

        return graph_us(step)
    import flashinfer

    tensor_cores, no_split = VARIANTS[variant]
    kv = [(torch.randn(pages, KV_HEADS, page_size, HEAD_DIM, device=device).to(kv_dtype),
           torch.randn(pages, KV_HEADS, page_size, HEAD_DIM, device=device).to(kv_dtype)) for _ in range(LAYERS)]
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=indptr.clone(),
        paged_kv_indices_buffer=indices.clone(), paged_kv_last_page_len_buffer=last.clone(), backend="fa2")
    extra = {"disable_split_kv": True} if no_split else {}
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page_size, q_data_type=torch.bfloat16,
                 kv_data_type=kv_dtype, **extra)
    out = torch.empty_like(q)

    def step():
        for k, v in kv:
            wrapper.run(q, (k, v), out=out)

    return graph_us(step)


def graph_us(step) -> float:
    """Microseconds per layer of `step` (all LAYERS layers) replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 20
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--kv-lens", default="256,1024,2048")
    parser.add_argument("--kv-dtypes", default="bf16,fp8_e4m3")
    # FlashInfer 0.6.11: FP8 KV with disable_split_kv in graph mode fails with a CUDA error that
    # poisons the process (cudaErrorInvalidAddressSpace), so leave the *_no_split variants out there.
    parser.add_argument("--page-sizes", default="1")
    parser.add_argument("--variants", default=",".join([*VARIANTS, "triton"]))
    parser.add_argument("--triton-sweep", action="store_true", help="also time tile choices of the FP8 kernel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rep = Reporter(args.out, "python " + shlex.join(sys.argv))
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    for page_size, kv_name, batch, kv_len in itertools.product(args.page_sizes.split(","), args.kv_dtypes.split(","),
                                                               args.batch_sizes.split(","), args.kv_lens.split(",")):
        page_size, batch, kv_len = int(page_size), int(batch), int(kv_len)
        us = {}
        for name in args.variants.split(","):
            try:
                us[name] = round(layer_us(batch, kv_len, name, dtypes[kv_name], page_size=page_size), 2)
            except Exception as e:  # a variant this FlashInfer does not offer
                us[name] = f"{type(e).__name__}: {str(e)[:120]}"
        if args.triton_sweep:
            for tiles in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
                try:
                    us[f"triton_{tiles[0]}_{tiles[1]}_{tiles[2]}"] = round(
                        layer_us(batch, kv_len, "triton", dtypes[kv_name], tiles, page_size), 2)
                except Exception as e:  # a tile that does not fit: skip it
                    print(f"# {tiles}: {type(e).__name__}", flush=True)
        base = us["tensor_cores"]
        rep.emit({"bench": "gpu_decode_attention", "kv_dtype": kv_name, "page_size": page_size, "batch": batch,
                  "kv_len": kv_len,
                  "us_per_layer": us,
                  "baseline": "tensor_cores (the engine's decode wrapper), measured in this run",
                  "speedup_vs_baseline": {k: round(base / v, 3) for k, v in us.items()
                                          if isinstance(v, float) and isinstance(base, float)}})


if __name__ == "__main__":
    main()
