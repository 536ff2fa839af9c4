"""Per-token FP8 quantization of activations in Triton (CUDA): each program takes one row, finds
its absolute maximum, then writes row / scale in e4m3 and the scale.

At prefill sizes the FP8 projections' inputs come from an RMSNorm (qkv, gate_up) or from
SiLU-and-mul (down). `rms_norm_quant` and `silu_and_mul_quant` do that op and the quantization
in one pass, so the bf16 row is neither written nor read back. They round the op's output to
the model dtype before quantizing, as the separate kernels do, so the e4m3 values and scales
are the very same.
"""

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
                 k_scale: float, v_scale: float, pdl: bool = True) -> None:
    """Stores k / k_scale and v / v_scale, saturated to e4m3, into the head-major FP8 pool
    (k_buf, v_buf: [Hkv, S, D]; k, v: [T, Hkv, D], any token/head strides) in one launch."""
    num_tokens, num_heads, head_dim = k.shape
    pdl = pdl_enabled(k, pdl)
    _store_kv_fp8_kernel[(num_tokens, num_heads)](
        k, v, slots, k_buf, v_buf, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0),
        k_buf.stride(1), 1.0 / k_scale, 1.0 / v_scale, FP8_MAX=_FP8_MAX, HEAD_DIM=head_dim, PDL=pdl,
        launch_pdl=pdl)


@triton.jit
def _quantize_row(y, q_row, scale_ptr, cols, mask, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """Writes the fp32 row `y` (already rounded to the model dtype) as e4m3 and its scale."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, EPS)
    tl.store(scale_ptr, scale)
    tl.store(q_row + cols, tl.clamp(y / scale, -FP8_MAX, FP8_MAX).to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, n_cols, x_stride, res_stride, eps,
                          HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # as triton_ops' add_rms_norm: the sum rounded to the stream's dtype, kept
        x = (x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd * w).to(x.dtype).to(tl.float32)
    _quantize_row(y, q_ptr + row * n_cols, scale_ptr + row, cols, mask, FP8_MAX, EPS)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token(rms_norm(x [+ residual])) in one launch: (e4m3 [M, K], float32 [M, 1]).
    With a residual, residual += x in place first (triton_ops.add_rms_norm's contract)."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(k)  # 4 warps, as triton_ops' norm: the same sum order
        res = x if residual is None else residual
        _rmsnorm_quant_kernel[(rows,)](x, res, weight, q, scale, k, x.stride(0), res.stride(0), eps,
                                       HAS_RESIDUAL=residual is not None, FP8_MAX=_FP8_MAX, EPS=_EPS, BLOCK=block)
    return q, scale


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, n_cols, x_stride, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    # As triton_ops' silu_and_mul: silu(gate) rounded to the input dtype, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    _quantize_row((act * up).to(tl.float32), q_ptr + row * n_cols, scale_ptr + row, cols, mask, FP8_MAX, EPS)


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token(silu(gate) * up) for x [M, 2 * I] (gate | up) in one launch."""
    rows, n = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _silu_and_mul_quant_kernel[(rows,)](x, q, scale, n, x.stride(0), FP8_MAX=_FP8_MAX, EPS=_EPS,
                                            BLOCK=triton.next_power_of_2(n), num_warps=16)
    return q, scale
