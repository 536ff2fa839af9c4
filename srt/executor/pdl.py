"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A batch-1 decode step is a chain of ~11 short kernels per layer (norm, projections, rotary,
KV store, attention). Launched plainly, each one starts only after the one before it has
finished, and then pays its own block start-up and first-byte latency: ~2-3 us of a 5-30 us
kernel. Launched with PDL, a kernel may start while its predecessor still runs: it lets its own
successor launch at once (`launch_dependents`), loads what no earlier kernel writes (weights,
norm scales), and only then waits (`wait`) for the predecessor to finish and its writes to be
visible.

The rule for a kernel launched with `launch_pdl=pdl_enabled(...)`: before `wait` it may read
only constant data and may write nothing. A kernel launched without PDL (torch's, cuBLAS's)
after one of ours waits for it as usual, so mixing them is safe.

Whether to use it is the engine's KernelOptions.pdl (on unless --disable-pdl, for comparing or
for ruling it out when chasing a race), handed to each kernel's wrapper as `pdl`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor, requested: bool = True) -> bool:
    """Whether kernels working on `t` launch with PDL: when `requested`, on CUDA compute
    capability 9.0 or later."""
    if not requested or not t.is_cuda:
        return False
    return _device_supports_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
