"""LoRA's low-rank products as gathered GEMVs (`--lora-backend triton`, CUDA): each token reads
only its own adapter's A and B, where the torch path (layers.py) multiplies every slot's and
masks. Two kernels per projection whatever its parts, whose shapes are the batch's and the
slots' (a CUDA graph captures them):

- shrink: partial[t, p, s] = scaling[slot_t] * A[p, slot_t][:, K split s] @ x[t, K split s],
  for every part p (q|k|v of qkv_proj, gate|up of gate_up_proj), in fp32. K is cut into
  splits of K_PER_SPLIT, each read in one load by its own program: the kernels serve decode
  of small batches (layers.AUTO_TRITON_MAX_TOKENS), where a program walking K in a loop of
  dependent loads costs latency, not bandwidth;
- expand: out[t, n] += B[n, slot_t] @ sum_s partial[t, part(n), s], every part's columns in
  one launch. The partial sums are added in a fixed order (the result does not depend on
  the batch or on timing); where the parts' boundaries are multiples of BLOCK_N (every real
  model's) a program's columns lie in one part and it adds them once, not per column.

A token of the base model (its row is the slots' count) loads nothing and adds nothing.

Both launch with PDL (pdl.py) where the GPU has it: each lets its successor launch at once, and
loads the adapters' matrices before waiting for its predecessor (the expand its B while the
shrink still runs). The token rows it reads first count as constant: the step's rows are copied
before its forward starts, and no kernel of the forward writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..executor.pdl import launch_dependents, pdl_enabled, wait

K_PER_SPLIT = 512
BLOCK_K = 512  # >= K_PER_SPLIT: one load per program
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, scaling_ptr, h_ptr, K, stride_x, K_PER_SPLIT, NUM_SLOTS: tl.constexpr,
                   RANK: tl.constexpr, RANK_P2: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    t = tl.program_id(0)
    p = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + t)
    slot = tl.minimum(row, NUM_SLOTS - 1)
    r = tl.arange(0, RANK_P2)
    r_ok = (r < RANK) & (r * 0 + row < NUM_SLOTS)  # a base-model token loads nothing
    a_rows = (p * NUM_SLOTS + slot) * RANK + r  # lora_a's rows: part, then slot, then rank
    # K_PER_SPLIT <= BLOCK_K (one load of A and of x): A before the wait, x (the predecessor's
    # input, maybe still being written by an earlier kernel) after it.
    k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    k_ok = (k < tl.minimum(split * K_PER_SPLIT + K_PER_SPLIT, K)) & (k * 0 + row < NUM_SLOTS)
    a = tl.load(a_ptr + a_rows[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    wait(PDL)
    xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    scaling = tl.load(scaling_ptr + slot)
    out = ((t * tl.num_programs(1) + p) * tl.num_programs(2) + split) * RANK_P2 + r
    tl.store(h_ptr + out, acc * scaling)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, rows_ptr, out_ptr, N, stride_out, BOUND1, BOUND2, NUM_PARTS: tl.constexpr,
                   SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, ALIGNED: tl.constexpr, NUM_SLOTS: tl.constexpr,
                   RANK: tl.constexpr, RANK_P2: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.load(rows_ptr + t)
    slot = tl.minimum(row, NUM_SLOTS - 1)
    r = tl.arange(0, RANK_P2)
    r_ok = (r < RANK) & (r * 0 + row < NUM_SLOTS)
    n_ok = (n < N) & (n * 0 + row < NUM_SLOTS)
    hmask = n_ok[:, None] & r_ok[None, :]
    # B is [N, slots * rank]: slot s's columns are [s * rank, (s + 1) * rank). Read while the
    # shrink runs; the partial sums and the output only after it.
    b = tl.load(b_ptr + n[:, None] * (NUM_SLOTS * RANK) + slot * RANK + r[None, :], mask=hmask, other=0.0)
    wait(PDL)
    if ALIGNED:  # the program's columns are all in the part of its first
        n0 = tl.program_id(1) * BLOCK_N
        part = (n0 >= BOUND1).to(tl.int32) + (n0 >= BOUND2).to(tl.int32)
        s = tl.arange(0, SPLITS_P2)
        partials = tl.load(h_ptr + ((t * NUM_PARTS + part) * SPLITS + s[:, None]) * RANK_P2 + r[None, :],
                           mask=(s[:, None] < SPLITS) & r_ok[None, :], other=0.0)
        h = tl.sum(partials, axis=0)[None, :]
    else:  # parts' first columns: 0, BOUND1, BOUND2
        part = (n >= BOUND1).to(tl.int32) + (n >= BOUND2).to(tl.int32)
        first = ((t * NUM_PARTS + part[:, None]) * SPLITS) * RANK_P2 + r[None, :]
        h = tl.load(h_ptr + first, mask=hmask, other=0.0)
        for split in tl.static_range(1, SPLITS):
            h += tl.load(h_ptr + first + split * RANK_P2, mask=hmask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * h, axis=1)
    out = tl.load(out_ptr + t * stride_out + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + t * stride_out + n, (out.to(tl.float32) + delta).to(out.dtype), mask=n_ok)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       offsets: list[tuple[int, int]], rows: torch.Tensor, scaling: torch.Tensor, num_slots: int,
                       rank: int, pdl: bool = True) -> torch.Tensor:
    """out (the base projection's output, [T, N]) plus every token's own adapter's product.
    lora_b: every part's B stacked by output rows, [N, slots * rank]; offsets: each part's
    columns of `out`; rows: [T] each token's slot (num_slots: the base model); scaling:
    [num_slots] fp32; pdl: launch with PDL where the GPU has it (KernelOptions.pdl)."""
    tokens, fan_in = x.shape
    pdl = pdl_enabled(x, pdl)
    rank_p2 = triton.next_power_of_2(rank)
    parts = len(offsets)
    if parts > 3:
        raise ValueError(f"lora_shrink_expand: {parts} parts (at most 3)")
    if K_PER_SPLIT > BLOCK_K:  # the shrink reads a split in one load
        raise ValueError(f"lora_shrink_expand: K_PER_SPLIT {K_PER_SPLIT} > BLOCK_K {BLOCK_K}")
    splits = triton.cdiv(fan_in, K_PER_SPLIT)
    h = torch.empty(tokens, parts, splits, rank_p2, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    _shrink_kernel[(tokens, parts, splits)](x, lora_a, rows, scaling, h, fan_in, x.stride(0), K_PER_SPLIT,
                                            NUM_SLOTS=num_slots, RANK=rank, RANK_P2=rank_p2, BLOCK_K=BLOCK_K,
                                            PDL=pdl, launch_pdl=pdl)
    n = offsets[-1][1]
    bounds = [start for start, _ in offsets[1:]] + [n] * (3 - parts)
    aligned = all(b % BLOCK_N == 0 for b in bounds[:parts - 1])
    _expand_kernel[(tokens, triton.cdiv(n, BLOCK_N))](
        h, lora_b, rows, out, n, out.stride(0), bounds[0], bounds[1], NUM_PARTS=parts, SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), ALIGNED=aligned, NUM_SLOTS=num_slots, RANK=rank, RANK_P2=rank_p2,
        BLOCK_N=BLOCK_N, PDL=pdl, launch_pdl=pdl)
    return out
