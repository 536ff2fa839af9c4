"""What a tensor-parallel all-reduce costs on two GPUs, as decode uses it: bf16 [batch, hidden]
sums replayed from a CUDA graph, through NCCL (the baseline) and through the opt-in one-shot
all-reduce on symmetric memory (--tp-all-reduce one_shot). One JSON line per size with
microseconds per all-reduce for each, the ratio, and whether the sums agree.

  python -m benchmarks.bench_gpu_allreduce --out benchmarks/results/gpu_h200x2_allreduce.jsonl

At batch 1 the Llama-3.1-70B shape runs 160 of them a step (hidden 8192): at ~15 us each they
are ~2.4 ms of a ~19 ms step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

from .gpu_measure import gpu_reporter
from .harness import free_port

CALLS_PER_GRAPH = 160  # the 70B shape's all-reduces in one decode step


def _worker(rank: int, addr: str, sizes: list[tuple[int, int]], queue) -> None:
    import torch

    import dataclasses

    from radixlm.srt.executor import parallel
    from radixlm.srt.server_args import ServerArgs

    args = ServerArgs(tp_size=2, dist_timeout=60.0, device="cuda", dtype="bfloat16", tp_all_reduce="one_shot")
    parallel.prepare_rank(args, rank)
    paths = {"one_shot": parallel.init_tensor_parallel(args, rank, rank, addr)}
    paths["nccl"] = dataclasses.replace(paths["one_shot"], one_shot_buffer=None)
    results = []
    for batch, hidden in sizes:
        line = {"batch": batch, "hidden": hidden}
        x = torch.full((batch, hidden), float(rank + 1), dtype=torch.bfloat16, device=torch.device("cuda", rank))
        for path in ("nccl", "one_shot"):
            if paths[path].one_shot_buffer is None and path == "one_shot":
                line["one_shot"] = "unavailable"
                continue
            line[f"{path}_us"], line[f"{path}_sum_ok"] = _time_graph(paths[path], x)
        results.append(line)
    if rank == 0:
        queue.put(results)
    parallel.shutdown()


def _time_graph(tp, x) -> tuple[float, bool]:
    import torch

    buf = x.clone()
    for _ in range(3):  # warm-up, eagerly
        buf.copy_(x)
        tp.all_reduce(buf)
    ok = bool((buf == 3.0).all())  # ranks hold 1 and 2
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS_PER_GRAPH):
                tp.all_reduce(buf)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return round(best, 2), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_gpu_allreduce needs two GPUs")
    addr = f"127.0.0.1:{free_port()}"
    sizes = [(1, 4096), (1, 8192), (8, 8192), (64, 8192), (256, 8192)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, addr, sizes, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    rep = gpu_reporter(args.out)
    for line in results:
        line = {"bench": "gpu_tp_all_reduce", **line, "calls_per_graph": CALLS_PER_GRAPH, "baseline": "nccl in this run",
                "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}}
        if isinstance(line.get("one_shot_us"), float):
            line["one_shot_vs_nccl"] = round(line["one_shot_us"] / line["nccl_us"], 3)
        rep.emit(line)


if __name__ == "__main__":
    main()
