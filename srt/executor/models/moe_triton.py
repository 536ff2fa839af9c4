"""Fused mixture-of-experts on CUDA: token-expert pairs sorted by expert, then two grouped GEMMs.

Each (token, k) pair is one row. The rows are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M, so every BLOCK_M-row tile belongs to one expert: a tile multiplies
its rows by that expert's weights only, and an expert no token picked costs nothing (only the
active experts' weights are read, which is what bounds batch-1 decode). Everything, the sort
included, runs on the device with shapes fixed by the token count, so there is no host sync
and a decode step can be captured in a CUDA graph.

  gate_up[pair] = x[pair // k] @ w13[e].T            (grouped GEMM 1)
  act[pair]     = silu(gate) * up                     (triton_ops.silu_and_mul)
  down[pair]    = weight[pair] * act[pair] @ w2[e].T  (grouped GEMM 2, scaled in fp32)
  out[t]        = sum over k of down[t * k + j]       (no atomics: deterministic)

The torch reference is moe.expert_forward; tests/test_gpu_models.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr, num_pairs, N, K,
                         stride_am, stride_be, stride_bn, stride_cm, A_ROW_DIV: tl.constexpr,
                         MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """C[pair, :N] = A[pair // A_ROW_DIV, :K] @ B[expert].T (times weight[pair]) for one
    BLOCK_M x BLOCK_N tile of the sorted pairs; B[e] is [N, K] row-major."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:  # a tile past the last expert's padded run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + offs_m)
    valid = pair < num_pairs  # padding rows of the expert's run hold num_pairs
    a_rows = tl.where(valid, pair // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _tile_config(num_pairs: int, num_experts: int) -> dict[str, int]:
    # Few rows per expert (decode): short tiles, long K steps, the GEMMs are weight-bandwidth bound.
    if num_pairs <= 4 * num_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index per sorted row, padded with num_pairs; expert per BLOCK_M tile, -1 past the
    end), with sizes fixed by the pair count so no value is read on the host."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    max_rows = num_pairs + num_experts * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    pairs = torch.full((max_rows,), num_pairs, dtype=torch.int64, device=device)
    pairs.scatter_(0, (padded_end - padded)[sorted_experts] + rank, order)
    tile_start = torch.arange(0, max_rows, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pairs, tile_expert


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor, tile_expert: torch.Tensor,
                  weights: torch.Tensor | None, a_row_div: int, config: dict[str, int]) -> None:
    num_pairs = out.shape[0]
    n, k = b.shape[1], b.shape[2]
    grid = (tile_expert.numel() * triton.cdiv(n, config["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](a, b, out, pairs, tile_expert, weights if weights is not None else out, num_pairs, n, k,
                               a.stride(0), b.stride(0), b.stride(1), out.stride(0), A_ROW_DIV=a_row_div,
                               MUL_WEIGHT=weights is not None, **config)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights [T, k] float32; ids [T, k] -> [T, H]."""
    from . import triton_ops

    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    num_pairs = num_tokens * top_k
    config = _tile_config(num_pairs, num_experts)
    pairs, tile_expert = sort_pairs(ids, num_experts, config["BLOCK_M"])
    x = x.contiguous()
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, pairs, tile_expert, None, top_k, config)
    act = triton_ops.silu_and_mul(gate_up, pdl=pdl)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, pairs, tile_expert, weights.reshape(-1).contiguous().float(), 1, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
