"""GPU timing and the ceilings the GPU benchmarks compare against, measured in the same run:
HBM bandwidth, the bf16 GEMM rate, and kernels replayed from a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .harness import Reporter, best_seconds, command_line


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_reporter(out: str | None) -> Reporter:
    """Lines framed with the device's name and this run's command line."""
    return Reporter(out, command=command_line(), device=device_name)


def gpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls, GPU work included."""
    return best_seconds(fn, repeats, sync=torch.cuda.synchronize)


def graph_replay_us(step: Callable[[], None], replays: int = 20) -> float:
    """Microseconds per replay of `step` captured into one CUDA graph (run once first outside
    the capture, which compiles Triton kernels)."""
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
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def measure_bandwidth() -> dict:
    """HBM bandwidth two ways: a read-only reduction over 8 GiB and a device-to-device copy."""
    x = torch.empty(4 * 2**30, dtype=torch.bfloat16, device="cuda").fill_(1)
    y = torch.empty_like(x)
    read_s = gpu_seconds(lambda: x.sum(dtype=torch.float32), 5)
    copy_s = gpu_seconds(lambda: y.copy_(x), 5)
    nbytes = x.numel() * 2
    x = y = None  # free the 16 GiB before empty_cache (the lambdas above are done with them)
    torch.cuda.empty_cache()
    return {"read_tb_s": nbytes / read_s / 1e12, "copy_tb_s": 2 * nbytes / copy_s / 1e12}


def measure_matmul_tflops() -> float:
    """bf16 GEMM 8192^3."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ b
    seconds = gpu_seconds(lambda: [a @ b for _ in range(10)], 3) / 10
    return 2 * 8192**3 / seconds / 1e12
