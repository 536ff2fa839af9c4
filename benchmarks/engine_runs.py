"""Timing an in-process Engine on the GPU: batch-1 decode ms/token, the offline workload, device
time split by step kind, profiles of one call, and freeing an engine for the next one."""

from __future__ import annotations

import gc
import sys

import torch

from .gpu_measure import gpu_seconds
from .harness import timed


def greedy(engine, prompt: list[int], n: int) -> None:
    """`n` tokens for one prompt (ignore_eos), then the cache flushed: the next call prefills again."""
    engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    engine.flush_cache()


def decode_ms_per_token(engine, prompt: list[int], short: int = 32, long: int = 288) -> float:
    """Batch-1 decode ms/token: (time for `long` tokens - time for `short`) / (long - short); the
    difference cancels prefill and per-request overhead, leaving pure decode steps."""
    greedy(engine, prompt, long)  # warm-up
    t_short = gpu_seconds(lambda: greedy(engine, prompt, short), 3)
    t_long = gpu_seconds(lambda: greedy(engine, prompt, long), 3)
    return (t_long - t_short) / (long - short) * 1e3


def offline_seconds(engine, prompts: list[list[int]], out_lens: list[int]) -> float:
    """Seconds for one generate call over all `prompts` (greedy, ignore_eos, `out_lens` tokens
    each); the cache is flushed after, and every token must have come."""
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in out_lens]
    outs, seconds = timed(engine.generate, input_ids=prompts, sampling_params=params)
    engine.flush_cache()
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(out_lens)
    return seconds


class StepTimer:
    """Wraps the runner's forward to split a run into device time spent in extend forwards, in
    decode forwards, and the rest (sampling, and the device idling while the host works).

    CUDA events, not host clocks: synchronizing after each forward would stop the scheduler
    from preparing the next step while this one runs (overlap scheduling)."""

    def __init__(self, runner):
        self.runner, self.inner = runner, runner.forward
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        runner.forward = self

    def __call__(self, batch, loads=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(batch, loads)
        end.record()
        self.events.append(("decode" if batch.is_decode else "extend", start, end))
        return out

    def split(self) -> tuple[dict[str, float], dict[str, int]]:
        """(device seconds, steps) per kind, for the forwards since the last reset."""
        torch.cuda.synchronize()
        seconds, steps = {"extend": 0.0, "decode": 0.0}, {"extend": 0, "decode": 0}
        for kind, start, end in self.events:
            seconds[kind] += start.elapsed_time(end) / 1e3
            steps[kind] += 1
        return seconds, steps

    def gaps(self) -> dict[str, float]:
        """Seconds between one forward's end and the next one's start on the device (sampling,
        the host's work the device waited for), summed by the kind of the forward that followed:
        where a run's idle device time is."""
        torch.cuda.synchronize()
        gaps = {"before_extend": 0.0, "before_decode": 0.0}
        for (_, _, end), (kind, start, _) in zip(self.events, self.events[1:]):
            gaps[f"before_{kind}"] += end.elapsed_time(start) / 1e3
        return {k: round(v, 2) for k, v in gaps.items()}

    def split_s(self, wall_seconds: float) -> tuple[dict[str, float], dict[str, int]]:
        """The report's "split_s" (device seconds per kind, and the rest of `wall_seconds`) and steps."""
        device_s, steps = self.split()
        return {"extend_forward_device": round(device_s["extend"], 2),
                "decode_forward_device": round(device_s["decode"], 2),
                "sampling_and_device_idle": round(wall_seconds - sum(device_s.values()), 2)}, steps

    def reset(self):
        self.events = []

    def remove(self):
        """Puts the runner's own forward back and lets go of the runner, so that neither keeps
        the engine's memory alive past its shutdown."""
        del self.runner.forward
        self.runner = self.inner = None


def run_offline(engine, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """The whole workload in one generate call (after a 16-request warm-up), with the device
    time split by step kind."""
    offline_seconds(engine, prompts[:16], out_lens[:16])  # warm-up
    timer = StepTimer(engine.scheduler.engine.runner)
    seconds = offline_seconds(engine, prompts, out_lens)
    split, steps = timer.split_s(seconds)
    timer.remove()
    out_tokens, in_tokens = sum(out_lens), sum(len(p) for p in prompts)
    return {"seconds": round(seconds, 2), "output_tok_s": round(out_tokens / seconds, 1),
            "total_tok_s": round((out_tokens + in_tokens) / seconds, 1), "split_s": split,
            "steps": steps, "kv_tokens": engine.scheduler.allocator.capacity}


def free_engine(engine) -> None:
    """Shuts the engine down and returns its GPU memory, for the next engine of the run."""
    engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def prefill_flops(config, prompts: int, length: int) -> float:
    """Model FLOPs of prefilling `prompts` prompts of `length` tokens: the layers' GEMMs and causal attention."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    linear = 2 * config.num_layers * layer_params * prompts * length
    attention = 2 * 2 * config.num_heads * config.head_dim * (length * length / 2) * config.num_layers * prompts
    return linear + attention


def profile(fn, title: str, rows: int = 18):
    """Prints the kernels that take the GPU time (and the host-side ops) for one call of `fn`;
    returns the profiler's per-name averages."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"# profile: {title}", flush=True)
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    return averages


def host_profile(fn, title: str, rows: int = 25) -> None:
    """Where the host spends a call of `fn` (Python functions, by their own time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    print(f"# host profile: {title}", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(rows)
