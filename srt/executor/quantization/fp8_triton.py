"""Per-token FP8 quantization of activations in one Triton launch (CUDA): each program takes one
row, finds its absolute maximum, then writes row / scale in e4m3 and the scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_dependents, pdl_enabled, wait

_FP8_MAX = 448.0
_EPS = 1e-12


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, EPS)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):  # the second read of the row hits the cache
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (last dim contiguous) -> (e4m3 [M, K] contiguous, float32 scales [M, 1])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(k), 4096)
        _quant_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), FP8_MAX=_FP8_MAX, EPS=_EPS, BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return q, scale


@triton.jit
def _store_kv_fp8_kernel(k_ptr, v_ptr, slot_ptr, k_buf_ptr, v_buf_ptr, k_stride_t, k_stride_h, v_stride_t,
                         v_stride_h, buf_stride_h, buf_stride_s, inv_k_scale, inv_v_scale, FP8_MAX: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    dst = h * buf_stride_h + slot * buf_stride_s + d
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d).to(tl.float32) * inv_k_scale
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d).to(tl.float32) * inv_v_scale
    tl.store(k_buf_ptr + dst, tl.clamp(k, -FP8_MAX, FP8_MAX).to(k_buf_ptr.dtype.element_ty))
    tl.store(v_buf_ptr + dst, tl.clamp(v, -FP8_MAX, FP8_MAX).to(v_buf_ptr.dtype.element_ty))


def store_kv_fp8(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_scale: float, v_scale: float) -> None:
    """Stores k / k_scale and v / v_scale, saturated to e4m3, into the head-major FP8 pool
    (k_buf, v_buf: [Hkv, S, D]; k, v: [T, Hkv, D], any token/head strides) in one launch."""
    num_tokens, num_heads, head_dim = k.shape
    pdl = pdl_enabled(k)
    _store_kv_fp8_kernel[(num_tokens, num_heads)](
        k, v, slots, k_buf, v_buf, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0),
        k_buf.stride(1), 1.0 / k_scale, 1.0 / v_scale, FP8_MAX=_FP8_MAX, HEAD_DIM=head_dim, PDL=pdl,
        launch_pdl=pdl)
