"""FP8 weights times a few activation rows (decode batches) in Triton: y = x @ (q * s)^T with
x in the model dtype (bf16/fp16), q the e4m3 weight [N, K] and s its per-channel scales.

Why not torch._scaled_mm for these: with one to a few rows the step is a matrix-vector product
that only has to stream the weights once at HBM bandwidth, and cuBLAS's FP8 GEMM reads them at
a fraction of it (batch-1 decode was no faster than bf16); it also needs the activations
quantized first (another launch per projection). Here the activations stay in the model dtype
(weight-only dequantization, W8A16): each e4m3 value is exact in bf16/fp16, so the tensor-core
dot multiplies exact values and sums them in fp32, and the only rounding is the weight's own.

Each program owns BLOCK_N output channels and a 1/SPLIT_K share of K. Split-K programs write
fp32 partial sums that one small kernel adds and scales; with SPLIT_K == 1 the scale is applied
in place. The tile sizes per shape come from `gemv_config` (measured on the H200 by
benchmarks/bench_gpu_fp8_gemv.py). Prefetching the weights into L2 before the PDL wait was
tried and made decode slower (docs/experiments.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..pdl import launch_dependents, pdl_enabled, wait

MAX_ROWS = 16  # the dot's smallest M tile; more rows go through _scaled_mm


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * K  # column n of W^T is row n of W: K contiguous
    # The first weight tile is read before waiting for the kernel that writes x (see pdl.py).
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    if EVEN:  # N and the split K are whole tiles: no masks on the weights
        w = tl.load(w_cols + offs_k[:, None])
    else:
        w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :] & (offs_k < K)[:, None], other=0.0)
    wait(PDL)
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = tl.dot(x, w.to(x.dtype), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
    for k0 in range(k_begin + BLOCK_K, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(w_cols + offs_k[:, None])
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
    if SPLIT_K == 1:
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        out = acc * scale[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        part = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8_gemv_row_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, N, K, k_per_split,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                         PDL: tl.constexpr):
    """One row (batch-1 decode): plain multiply-adds on [BLOCK_N, BLOCK_K] tiles read in the
    weight's own row-major layout, summed across K once at the end; no tensor-core layouts."""
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    # The first weight tile is read before waiting for the kernel that writes x (see pdl.py).
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    if EVEN:
        w = tl.load(w_rows + offs_k[None, :])
    else:
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    wait(PDL)
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(k_begin + BLOCK_K, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(w_rows + offs_k[None, :])
            x = tl.load(x_ptr + offs_k)
        else:
            k_mask = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        y *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, y, mask=n_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, scale_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    launch_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    scale = tl.load(scale_ptr + n, mask=mask, other=0.0)
    wait(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    acc *= scale
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)  # called per projection per eager step: a few shapes
def gemv_config(rows: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """Tiles for `rows` rows times an [N, K] weight: enough programs to keep every SM streaming
    (split K when the output channels alone give too few)."""
    if rows == 1:
        block_n, block_k, warps, stages = _row_tiles(n)
    else:
        block_n, block_k, warps, stages = 32, 256, 4, 3
    programs = triton.cdiv(n, block_n)
    split_k = 1
    while programs * split_k < 2 * sm_count and k % (2 * split_k * block_k) == 0 and split_k < 8:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=stages)


def _row_tiles(n: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of the one-row kernel, the fastest of
    bench_gpu_fp8_gemv.py's sweep on the H200 for the Llama-3.1-8B projections (docs/gpu.md):
    8 KB of weight per loop step, in shorter rows as N grows (more programs in flight)."""
    if n <= 4096:  # o_proj, down_proj
        return 8, 1024, 4, 3
    if n <= 8192:  # qkv_proj
        return 16, 512, 8, 3
    return 16, 256, 4, 3  # gate_up_proj


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
             config: GemvConfig | None = None, pdl: bool = True) -> torch.Tensor:
    """[M <= MAX_ROWS, K] (bf16/fp16) x e4m3 [N, K] with float32 scales ([N] or [1, N]) -> [M, N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, got {rows}")
    if config is None:
        config = gemv_config(rows, n, k, _sm_count(x.device.index or 0))
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    even = n % config.block_n == 0 and k % config.block_k == 0 and k_per_split * split == k
    part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, config.block_n), split)
    pdl = pdl_enabled(x, pdl)
    if rows == 1:
        _fp8_gemv_row_kernel[grid](x, weight, weight_scale, out, part, n, k, k_per_split, BLOCK_N=config.block_n,
                                   BLOCK_K=config.block_k, SPLIT_K=split, EVEN=even, PDL=pdl,
                                   num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    else:
        _fp8_gemv_kernel[grid](x, weight, weight_scale, out, part, rows, n, k, x.stride(0), out.stride(0),
                               k_per_split, BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                               SPLIT_K=split, EVEN=even, PDL=pdl, num_warps=config.num_warps,
                               num_stages=config.num_stages, launch_pdl=pdl)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n, block),)](part, weight_scale, out, rows, n, out.stride(0),
                                                            SPLIT_K=split, BLOCK=block, PDL=pdl, launch_pdl=pdl)
    return out
