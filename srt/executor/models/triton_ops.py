"""Triton kernels for the passes torch splits into many small kernels on the GPU.

At batch 1 a decode step is ~30 elementwise launches per layer in plain torch (casts, the
rotate-half concat, the residual add, the norm); each costs a few microseconds even inside a
CUDA graph, which is a large share of a ~4 ms step. These kernels do each job in one launch.
Imported only on CUDA (triton is in the `gpu` extra); the torch versions in `ops.py` are the
reference they are tested against (TRITON_INTERPRET=1 runs them on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_dependents, pdl_enabled, wait


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the residual stream's dtype first, as `x + residual` in torch is.
        x = (x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * out_stride + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True) -> torch.Tensor:
    out = torch.empty_like(x)
    pdl = pdl_enabled(x, pdl)
    _rmsnorm_kernel[(x.shape[0],)](x, x, weight, out, x.shape[1], x.stride(0), x.stride(0), out.stride(0), eps,
                                   HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(x.shape[1]), PDL=pdl,
                                   launch_pdl=pdl)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place); returns (rms_norm(residual), residual)."""
    out = torch.empty_like(x)
    pdl = pdl_enabled(x, pdl)
    _rmsnorm_kernel[(x.shape[0],)](x, residual, weight, out, x.shape[1], x.stride(0), residual.stride(0),
                                   out.stride(0), eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(x.shape[1]),
                                   PDL=pdl, launch_pdl=pdl)
    return out, residual


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    # Round silu(gate) to the input dtype before the product, as torch's two-step version does.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * out_stride + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> silu(gate) * up: [T, I]."""
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    pdl = pdl_enabled(x, pdl)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                                                              PDL=pdl, launch_pdl=pdl)
    return out


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate-half on the halves x1, x2 of heads, with torch's rounding in the model dtype: cos
    and sin cast first, each product rounded, then the sum."""
    c = cos.to(x1.dtype)[None, :]
    s = sin.to(x1.dtype)[None, :]
    return (((x1 * c).to(x1.dtype) - (x2 * s).to(x1.dtype)).to(x1.dtype),
            ((x2 * c).to(x1.dtype) + (x1 * s).to(x1.dtype)).to(x1.dtype))


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, x_stride_t, x_stride_h, cache_stride, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)  # q and k come from the projection before
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    # cos/sin caches hold each frequency twice ([f | f]); the first half is enough here.
    cos = tl.load(cos_ptr + pos * cache_stride + d)
    sin = tl.load(sin_ptr + pos * cache_stride + d)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = heads[:, None] < num_heads
    base = x_ptr + t * x_stride_t + heads[:, None] * x_stride_h + d[None, :]
    x1, x2 = _rotate(tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0), cos, sin)
    tl.store(base, x1, mask=mask)
    tl.store(base + HALF, x2, mask=mask)


def rotary_inplace(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   pdl: bool = True) -> None:
    """Rotates x: [T, H, D] (any token/head strides, unit feature stride) in place."""
    num_tokens, num_heads, head_dim = x.shape
    block_h = min(triton.next_power_of_2(num_heads), 16)
    pdl = pdl_enabled(x, pdl)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, positions, cos_cache, sin_cache, x.stride(0), x.stride(1), cos_cache.stride(0), num_heads,
        HALF=head_dim // 2, BLOCK_H=block_h, PDL=pdl, launch_pdl=pdl)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slot_ptr, k_buf_ptr, v_buf_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     buf_stride_h, buf_stride_s, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    dst = h * buf_stride_h + slot * buf_stride_s + d
    tl.store(k_buf_ptr + dst, tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d))
    tl.store(v_buf_ptr + dst, tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d))


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             pdl: bool = True) -> None:
    """k_buf, v_buf: [Hkv, S, D] head-major pool; k, v: [T, Hkv, D] (strided is fine)."""
    num_tokens, num_heads, head_dim = k.shape
    pdl = pdl_enabled(k, pdl)
    _store_kv_kernel[(num_tokens, num_heads)](
        k, v, slots, k_buf, v_buf, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), HEAD_DIM=head_dim, PDL=pdl, launch_pdl=pdl)


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_buf_ptr, v_buf_ptr,
                            q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cache_stride,
                            buf_stride_h, buf_stride_s, inv_k_scale, inv_v_scale, GROUP: tl.constexpr,
                            BLOCK_G: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                            PDL: tl.constexpr):
    """Program (token t, KV head h): rotates h's query group and its key in place, then writes the
    key and value into the pool (as e4m3 over their scales when FP8)."""
    launch_dependents(PDL)
    wait(PDL)  # q, k and v come from the projection before
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * cache_stride + d)
    sin = tl.load(sin_ptr + pos * cache_stride + d)
    g = tl.arange(0, BLOCK_G)
    g_mask = g[:, None] < GROUP
    q_base = q_ptr + t * q_stride_t + (h * GROUP + g)[:, None] * q_stride_h + d[None, :]
    q1, q2 = _rotate(tl.load(q_base, mask=g_mask, other=0.0), tl.load(q_base + HALF, mask=g_mask, other=0.0), cos, sin)
    tl.store(q_base, q1, mask=g_mask)
    tl.store(q_base + HALF, q2, mask=g_mask)
    k_base = k_ptr + t * k_stride_t + h * k_stride_h + d[None, :]
    k1, k2 = _rotate(tl.load(k_base), tl.load(k_base + HALF), cos, sin)
    tl.store(k_base, k1)  # the ragged prefill of an FP8 pool attends the fresh keys
    tl.store(k_base + HALF, k2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = h * buf_stride_h + slot * buf_stride_s + d[None, :]
    v_base = v_ptr + t * v_stride_t + h * v_stride_h + d[None, :]
    v1 = tl.load(v_base)
    v2 = tl.load(v_base + HALF)
    if FP8:  # as fp8_triton.store_kv_fp8: saturate x / scale, then cast
        out_ty = k_buf_ptr.dtype.element_ty
        k1 = tl.clamp(k1.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX).to(out_ty)
        k2 = tl.clamp(k2.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX).to(out_ty)
        v1 = tl.clamp(v1.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX).to(out_ty)
        v2 = tl.clamp(v2.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX).to(out_ty)
    tl.store(k_buf_ptr + dst, k1)
    tl.store(k_buf_ptr + dst + HALF, k2)
    tl.store(v_buf_ptr + dst, v1)
    tl.store(v_buf_ptr + dst + HALF, v2)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = True) -> None:
    """rotary_inplace on q [T, Hq, D] and k [T, Hkv, D], then store_kv (or, for an FP8 pool,
    fp8_triton.store_kv_fp8 with the scales) of k and v, in one launch: the same bytes as the
    two (decode runs one short kernel less per layer). Hq must be a multiple of Hkv."""
    num_tokens, num_kv_heads, head_dim = k.shape
    group = q.shape[1] // num_kv_heads
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    pdl = pdl_enabled(q, pdl)
    _rotary_store_kv_kernel[(num_tokens, num_kv_heads)](
        q, k, v, positions, cos_cache, sin_cache, slots, k_buf, v_buf, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0), k_buf.stride(0), k_buf.stride(1), 1.0 / k_scale,
        1.0 / v_scale, GROUP=group, BLOCK_G=triton.next_power_of_2(group), HALF=head_dim // 2, FP8=fp8,
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max, PDL=pdl, launch_pdl=pdl)
