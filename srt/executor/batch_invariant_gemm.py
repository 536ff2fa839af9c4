"""A batch-invariant GEMM for CUDA (--enable-deterministic-inference): y = x @ w^T (+ b).

cuBLAS picks its kernel, tile and split-K from the matrix shapes, so a row's bits change with
the number of rows in the batch. This kernel has one configuration for every shape: tiles of
BLOCK_M x BLOCK_N, the K axis walked in BLOCK_K steps from 0 up in one program (no split-K),
fp32 accumulation, the same tensor-core instruction for every tile. A row's result therefore
depends on its own values and the weight only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 128, 64, 8
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    # Grouped order: GROUP_M row tiles share each column tile while it is in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_tile, mask=(rows[:, None] < M) & (k + ks[None, :] < K), other=0.0)
        w = tl.load(w_tile, mask=(cols[None, :] < N) & (k + ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each row the same bits
    whatever M is."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _gemm_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
                       y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       GROUP_M=GROUP_M, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
