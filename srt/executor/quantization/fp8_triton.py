"""Per-token FP8 quantization of activations in one Triton launch (CUDA): each program takes one
row, finds its absolute maximum, then writes row / scale in e4m3 and the scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
                         HEAD_DIM: tl.constexpr):
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
    _store_kv_fp8_kernel[(num_tokens, num_heads)](
        k, v, slots, k_buf, v_buf, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0),
        k_buf.stride(1), 1.0 / k_scale, 1.0 / v_scale, FP8_MAX=_FP8_MAX, HEAD_DIM=head_dim)


@triton.jit
def _fp8_skinny_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                       FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """out = quant(x) @ w^T * x_scale * w_scale for a few rows: each program owns BLOCK_N output
    channels, finds the rows' absmax itself (x is small and stays in cache), quantizes x per
    token as quantize_per_token does, and streams its weight rows once. e4m3 values are exact
    in bf16 and so are their products in fp32: the bf16 dot computes what _scaled_mm does."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    x_scale = tl.maximum(amax / FP8_MAX, EPS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        xq = tl.clamp(x / x_scale[:, None], -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty).to(tl.bfloat16)
        w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=n_mask[None, :] & (offs_k[:, None] < K),
                    other=0.0)
        acc += tl.dot(xq, w.to(tl.bfloat16))
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


SKINNY_MAX_ROWS = 16  # up to here one launch reads the weights once; more rows go through _scaled_mm
# Not tuned: BLOCK_N 32 / BLOCK_K 256 / 4 stages read the weights at about a third of the HBM
# bandwidth on the H200 (batch-1 decode 7.3 ms/token vs _scaled_mm's 5.2); split-K and larger
# tiles are the next things to try.


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """[M <= 16, K] (model dtype) x e4m3 [N, K] with float32 scales [1, N] -> [M, N] in out_dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    block_n = 32
    _fp8_skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, out, rows, n, k, x.stride(0), out.stride(0), FP8_MAX=_FP8_MAX, EPS=_EPS,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, num_warps=4, num_stages=4)
    return out
