"""A batch-invariant GEMM for CUDA (--enable-deterministic-inference): y = x @ w^T (+ b).

cuBLAS picks its kernel, tile and split-K from the matrix shapes, so a row's bits change with
the number of rows in the batch. This kernel has one configuration for every shape: tiles of
BLOCK_M x BLOCK_N, fp32 accumulation, the same tensor-core instruction for every tile, and the K
axis cut into chunks of CHUNK_K positions from 0 (BLOCK_K steps each, in order). Each chunk is
accumulated from zero and the chunks' sums are added in K order. A call of few tiles (a decode
step: o_proj and down_proj have 32 column tiles at 4096 outputs) runs split: a program per
(tile, chunk) writes its chunk's sum and a second kernel adds them in order; every other call
walks the chunks in one program and adds as it goes. Both add the same fp32 values in the same
order, so a row's result depends on its own values and the weight only, split or not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 128, 64, 8
CHUNK_K = 1024  # K positions a split program sums (a multiple of BLOCK_K)
NUM_WARPS, NUM_STAGES = 4, 4
# Calls of fewer tiles than this run split, when their chunks' sums fit SPLIT_WORKSPACE_BYTES.
SPLIT_BELOW_TILES = 64
SPLIT_WORKSPACE_BYTES = 64 << 20
_REDUCE_BLOCK = 1024


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, CHUNK_K: tl.constexpr, SPLIT: tl.constexpr):
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
    k_lo = 0
    k_hi = K
    if SPLIT:  # this program's chunk only
        k_lo = tl.program_id(1) * CHUNK_K
        k_hi = tl.minimum(k_lo + CHUNK_K, K)
    x_tile = x_ptr + rows[:, None] * stride_xm + k_lo + ks[None, :]
    w_tile = w_ptr + cols[None, :] * stride_wn + k_lo + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_tile, mask=(rows[:, None] < M) & (k + ks[None, :] < K), other=0.0)
        w = tl.load(w_tile, mask=(cols[None, :] < N) & (k + ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
        if not SPLIT:  # a chunk ends: add its sum to the total, start the next from zero
            if (k + BLOCK_K) % CHUNK_K == 0:
                total = total + acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    # The last chunk (a split program's only one; else one shorter than CHUNK_K, or zeros).
    total = total + acc
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT:
        part = part_ptr + (tl.program_id(1) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part, total, mask=inside)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], total.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, chunks, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """A split call's output: its chunks' sums added in K order, as the sequential kernel adds them."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, chunks):
        total = total + tl.load(part_ptr + c * M * N + offs, mask=inside, other=0.0)
    col = offs % N
    if HAS_BIAS:
        total += tl.load(b_ptr + col, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N) * stride_ym + col, total.to(y_ptr.dtype.element_ty), mask=inside)


def split_chunks(m: int, n: int, k: int) -> int:
    """K chunks of a call that runs split (few tiles, its chunks' sums within the workspace
    bound), else 0: the call walks its chunks in one program per tile."""
    chunks = triton.cdiv(k, CHUNK_K)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    if chunks < 2 or tiles >= SPLIT_BELOW_TILES or chunks * m * n * 4 > SPLIT_WORKSPACE_BYTES:
        return 0
    return chunks


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
    chunks = split_chunks(m, n, k)
    part = torch.empty(chunks * m * n, dtype=torch.float32, device=x.device) if chunks else y
    b = bias if bias is not None else weight
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N), max(chunks, 1))
    _gemm_kernel[grid](x, weight, b, y, part, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                       CHUNK_K=CHUNK_K, SPLIT=chunks > 0, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                       enable_fp_fusion=False)
    if chunks:
        _reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](part, b, y, m, n, chunks, y.stride(0),
                                                             HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
                                                             num_warps=4, enable_fp_fusion=False)
    return y
