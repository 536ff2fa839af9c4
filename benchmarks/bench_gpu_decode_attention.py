"""Decode attention on one H200, Llama-3.1-8B attention shape (32 query heads, 8 KV heads,
head_dim 128, bf16 queries, bf16 or FP8 KV, pages of 1 or more, scattered as a busy pool has
them): microseconds per layer, 32 layers with their own KV replayed from one CUDA graph, as a
decode step runs them. The baseline is FlashInfer's tensor-core decode (split-KV as FlashInfer
plans it), measured in the same run; `triton` is the engine's own decode kernel
(srt/executor/attention/triton_decode.py) with the tiles and split count the engine picks, and
--triton-sweep times other tiles and split counts (to choose the engine's). `deterministic` and
`deterministic_sequential` are --enable-deterministic-inference's attention
(deterministic_triton.py, pages of 1 only): split into segment programs where its backend would
split the step, and with every request walked by one program (how it ran before the split).

    python -m benchmarks.bench_gpu_decode_attention --out benchmarks/results/gpu_h200.jsonl
    python -m benchmarks.bench_gpu_decode_attention --variants tensor_cores,deterministic,deterministic_sequential \
        --kv-lens 1024,4096 --batch-sizes 1,8,64
"""

from __future__ import annotations

import argparse
import itertools

import torch

from .gpu_measure import device_name, gpu_reporter, graph_replay_us
from .harness import run_frame
from .models import LLAMA_8B

HEADS, KV_HEADS, HEAD_DIM, LAYERS = LLAMA_8B.heads, LLAMA_8B.kv_heads, LLAMA_8B.head_dim, LLAMA_8B.layers
VARIANTS = {"tensor_cores": (True, False), "tensor_cores_no_split": (True, True), "cuda_cores": (False, False),
            "cuda_cores_no_split": (False, True)}
SWEEP_TILES = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (0, 1)))  # the last: V pairs (FP8)
SWEEP_SPLIT_FACTORS = (1, 2, 4)


class Case:
    """One batch's queries and page tables, and LAYERS layers of head-major K/V pools
    ([Hkv, slots, D], as KVPool holds them; FlashInfer reads them as HND pages by strides)."""

    def __init__(self, batch: int, kv_len: int, kv_dtype: torch.dtype, page_size: int):
        from radixlm.srt.executor.attention.paged_kv import as_pages

        device = torch.device("cuda")
        self.batch, self.kv_len, self.page_size, self.kv_dtype = batch, kv_len, page_size, kv_dtype
        pages_per_req = -(-kv_len // page_size)
        pages = batch * pages_per_req
        self.q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per_req
        self.indices = torch.randperm(pages, device=device).to(torch.int32)
        self.last = torch.full((batch,), kv_len - (pages_per_req - 1) * page_size, dtype=torch.int32, device=device)
        slots = pages * page_size
        self.pools = [(torch.randn(KV_HEADS, slots, HEAD_DIM, device=device).to(kv_dtype),
                       torch.randn(KV_HEADS, slots, HEAD_DIM, device=device).to(kv_dtype)) for _ in range(LAYERS)]
        self.pages = [(as_pages(k, page_size), as_pages(v, page_size)) for k, v in self.pools]

    def triton_us(self, tiles=None, splits=None) -> float:
        from radixlm.srt.executor.attention.triton_decode import DecodeTiles, paged_decode

        tiles = DecodeTiles(*tiles) if tiles else None

        def step():
            for k, v in self.pools:
                paged_decode(self.q, k, v, self.indptr, self.indices, self.last, self.page_size, HEAD_DIM ** -0.5,
                             splits=splits, tiles=tiles)

        return graph_replay_us(step) / LAYERS

    def deterministic_us(self, split: bool) -> float:
        from radixlm.srt.executor.attention import deterministic_triton as det

        if self.page_size != 1:
            raise ValueError("the deterministic attention reads pages of 1")
        rows = torch.arange(self.batch + 1, dtype=torch.int32, device=self.q.device)
        tables = det.Tables(rows, rows * self.kv_len, self.indices, rows[:-1], torch.zeros_like(rows[:-1]), self.batch)
        if split:
            tables = det.split_if_worth_it(tables, HEADS, KV_HEADS, HEAD_DIM, self.kv_len)
        out = self.q.new_empty(self.batch, HEADS * HEAD_DIM)

        def step():
            for k, v in self.pools:
                det.attend(self.q, k, v, tables, HEAD_DIM ** -0.5, out=out)

        return graph_replay_us(step) / LAYERS

    def flashinfer_us(self, variant: str) -> float:
        import flashinfer

        tensor_cores, no_split = VARIANTS[variant]
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=self.q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=self.indptr.clone(), paged_kv_indices_buffer=self.indices.clone(),
            paged_kv_last_page_len_buffer=self.last.clone(), backend="fa2")
        extra = {"disable_split_kv": True} if no_split else {}
        wrapper.plan(self.indptr, self.indices, self.last, HEADS, KV_HEADS, HEAD_DIM, self.page_size,
                     q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype, **extra)
        out = torch.empty_like(self.q)

        def step():
            for pages in self.pages:
                wrapper.run(self.q, pages, out=out)

        return graph_replay_us(step) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--kv-lens", default="256,1024,2048")
    parser.add_argument("--kv-dtypes", default="bf16,fp8_e4m3")
    parser.add_argument("--page-sizes", default="1")
    # FlashInfer 0.6.11: FP8 KV with disable_split_kv in graph mode fails with a CUDA error that
    # poisons the process (cudaErrorInvalidAddressSpace), so leave the *_no_split variants out there.
    parser.add_argument("--variants", default=",".join([*VARIANTS, "triton"]))
    parser.add_argument("--triton-sweep", action="store_true", help="also time other tiles and split counts")
    parser.add_argument("--sweep-tiles", default=None,
                        help="the sweep's tiles as TOKENS_WARPS_STAGES[_PAIRS],... (default: SWEEP_TILES)")
    parser.add_argument("--split-factors", default=",".join(map(str, SWEEP_SPLIT_FACTORS)),
                        help="the sweep's split counts, as multiples of the engine's")
    parser.add_argument("--split-counts", default=None,
                        help="comma-separated: also time the engine's tiles with each of these split counts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from radixlm.srt.executor.attention.triton_decode import DecodeTiles, decode_num_splits

    rep = gpu_reporter(args.out)
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for page_size, kv_name, batch, kv_len in itertools.product(args.page_sizes.split(","), args.kv_dtypes.split(","),
                                                               args.batch_sizes.split(","), args.kv_lens.split(",")):
        page_size, batch, kv_len = int(page_size), int(batch), int(kv_len)
        case = Case(batch, kv_len, dtypes[kv_name], page_size)
        us = {}
        for name in args.variants.split(","):
            try:
                if name.startswith("deterministic"):
                    us[name] = round(case.deterministic_us(split=name == "deterministic"), 2)
                else:
                    us[name] = round(case.triton_us() if name == "triton" else case.flashinfer_us(name), 2)
            except Exception as e:  # a variant this FlashInfer does not offer
                us[name] = f"{type(e).__name__}: {str(e)[:120]}"
        line = {"bench": "gpu_decode_attention", "kv_dtype": kv_name, "page_size": page_size, "batch": batch,
                "kv_len": kv_len, "us_per_layer": us}
        if args.triton_sweep:
            base_splits = decode_num_splits(batch, KV_HEADS, sm_count)
            sweep = {}
            tile_list = ([tuple(map(int, t.split("_"))) for t in args.sweep_tiles.split(",")] if args.sweep_tiles
                         else SWEEP_TILES)
            for tiles, factor in itertools.product(tile_list, map(int, args.split_factors.split(","))):
                splits = base_splits * factor
                try:
                    key = "_".join(map(str, (*map(int, DecodeTiles(*tiles)), splits)))
                    sweep[key] = round(case.triton_us(tiles, splits), 2)
                except Exception as e:  # a tile that does not fit: skip it
                    print(f"# {tiles} x {splits} splits: {type(e).__name__}", flush=True)
            best = min(sweep, key=sweep.get)
            line.update(triton_sweep_block_warps_stages_pairs_splits=sweep, triton_best=best,
                        triton_best_us=sweep[best])
        if args.split_counts:
            line["triton_us_by_splits"] = {splits: round(case.triton_us(splits=int(splits)), 2)
                                           for splits in args.split_counts.split(",")}
        del case
        torch.cuda.empty_cache()
        base = us["tensor_cores"]
        rep.emit({**line, **run_frame(device_name()),
                  "baseline": "tensor_cores (FlashInfer, the engine's decode wrapper), measured in this run",
                  "speedup_vs_baseline": {k: round(base / v, 3) for k, v in us.items()
                                          if isinstance(v, float) and isinstance(base, float)}})


if __name__ == "__main__":
    main()
