"""LoRA's low-rank products as gathered GEMVs (`--lora-backend triton`, CUDA): each token reads
only its own adapter's A and B, where the torch path (layers.py) multiplies every slot's and
masks. Two kernels per projection, whose shapes are the batch's and the slots' (a CUDA graph
captures them):

- shrink: h[t, p] = scaling[slot_t] * A[p, slot_t] @ x[t], for every part p (q|k|v of qkv_proj,
  gate|up of gate_up_proj), in fp32;
- expand: out[t, part p's columns] += B_p[:, slot_t] @ h[t, p].

A token of the base model (its row is the slots' count) loads nothing and adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, scaling_ptr, h_ptr, K, stride_x, NUM_SLOTS: tl.constexpr,
                   RANK: tl.constexpr, RANK_P2: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    p = tl.program_id(1)
    row = tl.load(rows_ptr + t)
    slot = tl.minimum(row, NUM_SLOTS - 1)
    r = tl.arange(0, RANK_P2)
    r_ok = (r < RANK) & (r * 0 + row < NUM_SLOTS)  # a base-model token loads nothing
    a_rows = (p * NUM_SLOTS + slot) * RANK + r  # lora_a's rows: part, then slot, then rank
    acc = tl.zeros([RANK_P2], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & (k * 0 + row < NUM_SLOTS)
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + a_rows[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    scaling = tl.load(scaling_ptr + slot)
    tl.store(h_ptr + (t * tl.num_programs(1) + p) * RANK_P2 + r, acc * scaling)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, rows_ptr, out_ptr, N, stride_out, NUM_PARTS, PART, NUM_SLOTS: tl.constexpr,
                   RANK: tl.constexpr, RANK_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.load(rows_ptr + t)
    slot = tl.minimum(row, NUM_SLOTS - 1)
    r = tl.arange(0, RANK_P2)
    r_ok = (r < RANK) & (r * 0 + row < NUM_SLOTS)
    n_ok = (n < N) & (n * 0 + row < NUM_SLOTS)
    h = tl.load(h_ptr + (t * NUM_PARTS + PART) * RANK_P2 + r, mask=r_ok, other=0.0)
    # B_p is [N, slots * rank]: slot s's columns are [s * rank, (s + 1) * rank).
    b = tl.load(b_ptr + n[:, None] * (NUM_SLOTS * RANK) + slot * RANK + r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    out = tl.load(out_ptr + t * stride_out + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + t * stride_out + n, (out.to(tl.float32) + delta).to(out.dtype), mask=n_ok)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, b_parts: list[torch.Tensor],
                       offsets: list[tuple[int, int]], rows: torch.Tensor, scaling: torch.Tensor, num_slots: int,
                       rank: int) -> torch.Tensor:
    """out (the base projection's output, [T, N]) plus every token's own adapter's product.
    rows: [T] each token's slot (num_slots: the base model); scaling: [num_slots] fp32."""
    tokens, fan_in = x.shape
    rank_p2 = triton.next_power_of_2(rank)
    parts = len(b_parts)
    h = torch.empty(tokens, parts, rank_p2, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    _shrink_kernel[(tokens, parts)](x, lora_a, rows, scaling, h, fan_in, x.stride(0), NUM_SLOTS=num_slots,
                                    RANK=rank, RANK_P2=rank_p2, BLOCK_K=128)
    for part, (b, (start, stop)) in enumerate(zip(b_parts, offsets)):
        view = out[:, start:stop]
        block_n = 64
        _expand_kernel[(tokens, triton.cdiv(stop - start, block_n))](
            h, b, rows, view, stop - start, out.stride(0), parts, part, NUM_SLOTS=num_slots, RANK=rank,
            RANK_P2=rank_p2, BLOCK_N=block_n)
    return out
