"""Paged decode attention in Triton, for the FlashInfer backend's plain decode steps (bf16, fp16
or FP8 e4m3 pools).

Why not FlashInfer's decode kernel: decode attention only has to stream each request's K and V
once, and FlashInfer's decode reads an FP8 pool no faster than a bf16 one. This kernel reads the
pool's bytes, widens FP8 in registers and runs the two small products on tensor cores; it is
faster at every batch size measured on the H200 (docs/gpu.md, "Decode attention").

One program per (request, KV head, split of the sequence): the KV head's whole query group
(padded to 16 rows, the dot's smallest tile) attends to its split with an online softmax. With
more than one split, each writes its normalized output and log-sum-exp, and a second kernel
merges them (flash-decoding). The split count is fixed per batch size (a CUDA graph needs a
fixed grid); each request cuts its own length into that many pieces at run time.

Variants that were measured and did not pay (merging the splits in this kernel, 32-bit token
offsets, head-dimension slices) are in docs/experiments.md.

Pages: request b's pages are indices[indptr[b]:indptr[b + 1]], its last page holds
last_page_len[b] tokens; token t of page p lives at slot p * page_size + t of the head-major
pool [Hkv, slots, D] (mem_pool.KVPool).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..pdl import launch_dependents, pdl_enabled, wait

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, last_len_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   stride_qb, stride_qh, stride_kh, stride_vh, stride_ob, stride_oh, qk_scale, v_scale,
                   WIDEN_FP16: tl.constexpr,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NUM_SPLITS: tl.constexpr, V_PAIRS: tl.constexpr,
                   PTX: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)  # the page tables and q come from earlier kernels and copies
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    page_begin = tl.load(indptr_ptr + b)
    num_pages = tl.load(indptr_ptr + b + 1) - page_begin
    seq_len = (num_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_T) * BLOCK_T
    t_begin = split * chunk
    t_end = tl.minimum(seq_len, t_begin + chunk)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    if WIDEN_FP16:  # see paged_decode: scores come out of the dot already scaled
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    # V_PAIRS (FP8 pools): V is read as 16-bit pairs of neighbouring values (see paged_decode),
    # and the even and odd columns of the output accumulate apart.
    half = tl.arange(0, HEAD_DIM // 2)
    acc_even = tl.zeros([BLOCK_G, HEAD_DIM // 2], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_G, HEAD_DIM // 2], dtype=tl.float32)
    v_pairs = v_head.to(tl.pointer_type(tl.int16))
    for t0 in range(t_begin, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < t_end
        page = tl.load(indices_ptr + page_begin + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + t % PAGE_SIZE
        k = tl.load(k_head + slot[:, None] * HEAD_DIM + d[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * score_scale  # log2 domain: sm_scale * k_scale * log2(e)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(q.dtype)
        if V_PAIRS:
            pairs = tl.load(v_pairs + slot[:, None] * (HEAD_DIM // 2) + half[None, :], mask=t_mask[:, None], other=0)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, _e4m3_pair_half_to_fp16(pairs, False, PTX))
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, _e4m3_pair_half_to_fp16(pairs, True, PTX))
        else:
            v = tl.load(v_head + slot[:, None] * HEAD_DIM + d[None, :], mask=t_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(p.dtype))
        m_i = m_new

    # An empty split (past a short request's end) leaves lse -inf and a zero output.
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    if NUM_SPLITS == 1:
        out_rows = out_ptr + b * stride_ob + q_heads[:, None] * stride_oh
        inv_l *= v_scale
    else:
        row = (b * NUM_SPLITS + split) * NUM_Q_HEADS + q_heads
        out_rows = part_out_ptr + row[:, None] * HEAD_DIM
        tl.store(part_lse_ptr + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")),
                 mask=g_mask)
    out_ty = out_rows.dtype.element_ty
    if V_PAIRS:
        tl.store(out_rows + 2 * half[None, :], (acc_even * inv_l[:, None]).to(out_ty), mask=g_mask[:, None])
        tl.store(out_rows + 2 * half[None, :] + 1, (acc_odd * inv_l[:, None]).to(out_ty), mask=g_mask[:, None])
    else:
        tl.store(out_rows + d[None, :], (acc * inv_l[:, None]).to(out_ty), mask=g_mask[:, None])


@triton.jit
def _e4m3_pair_half_to_fp16(pairs, HIGH: tl.constexpr, PTX: tl.constexpr):
    """The low (or HIGH) byte of each 16-bit word, as an e4m3 number, widened to fp16.

    With PTX (compiled for a GPU; the interpreter takes the casts): two words at a time, one
    byte permute gathers their low (high) bytes and one cvt widens both. Written as shifts, masks
    and casts, ptxas spent ~8 integer instructions per register moving bytes before each cvt
    (a quarter of the FP8 tile's loop; docs/gpu.md, "FP8 V read in pairs")."""
    if PTX:
        if HIGH:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, 0x3120; mov.b32 {lo, hi}, t; "
                "cvt.rn.f16x2.e4m3x2 $0, hi; }", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, 0x3120; mov.b32 {lo, hi}, t; "
                "cvt.rn.f16x2.e4m3x2 $0, lo; }", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2)
    else:
        bits = (pairs >> 8) if HIGH else pairs
        return (bits & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, v_scale, NUM_Q_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    rows = (b * NUM_SPLITS + s) * NUM_Q_HEADS + head
    lse = tl.load(part_lse_ptr + rows)
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # every request has a token, so one split is finite
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0) * v_scale
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _nvidia_ptx(q: torch.Tensor) -> bool:
    """Whether the kernel is compiled for an NVIDIA GPU, where its inline PTX runs (not for the
    interpreter on CPU, nor for ROCm)."""
    return q.is_cuda and torch.version.hip is None


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class DecodeTables(NamedTuple):
    """One decode step's page tables on the device (see the module docstring) and its split count."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    splits: int

    def attend(self, q: torch.Tensor, kv_pool, layer_id: int, page_size: int, sm_scale: float) -> torch.Tensor:
        """q [B, Hq, D] against layer `layer_id` of the KVPool, with its K/V scales (1 unless FP8)."""
        return paged_decode(q, kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id], self.indptr, self.indices,
                            self.last_page_len, page_size, sm_scale, kv_pool.k_scale, kv_pool.v_scale, self.splits,
                            pdl=kv_pool.pdl)


def decode_num_splits(batch_size: int, num_kv_heads: int, sm_count: int) -> int:
    """Splits per request: enough programs for about two per SM, a power of two up to MAX_SPLITS."""
    splits = 1
    while batch_size * num_kv_heads * splits < 2 * sm_count and splits < MAX_SPLITS:
        splits *= 2
    return splits


def load_decode_tables(kv, device: torch.device, num_kv_heads: int, sm_count: int,
                       meta: torch.Tensor | None = None, indices: torch.Tensor | None = None) -> DecodeTables:
    """A step's page tables (paged_kv.PagedKV, host int32) copied to the device: into `meta`
    (indptr, then last_page_len) and `indices` when given (a CUDA graph's fixed buffers), else
    into new tensors. From pinned memory, so the copies queue behind the running step instead of
    waiting for it (torch's pinned allocator keeps each buffer until its copy is done)."""
    batch = kv.last_page_len.numel()
    host_meta = torch.cat([kv.indptr, kv.last_page_len]).to(torch.int32).pin_memory()
    host_indices = kv.indices.to(torch.int32).pin_memory()
    if meta is None:
        meta = torch.empty(2 * batch + 1, dtype=torch.int32, device=device)
        indices = torch.empty(max(1, host_indices.numel()), dtype=torch.int32, device=device)
    meta[:2 * batch + 1].copy_(host_meta, non_blocking=True)
    indices[:host_indices.numel()].copy_(host_indices, non_blocking=True)
    return DecodeTables(meta[:batch + 1], indices, meta[batch + 1:2 * batch + 1],
                        decode_num_splits(batch, num_kv_heads, sm_count))


class DecodeTiles(NamedTuple):
    """The kernel's launch shape: tokens per loop step, warps, pipeline stages, and whether an FP8
    pool's V is read as 16-bit pairs (paged_decode's docstring)."""

    block_t: int
    num_warps: int
    num_stages: int
    v_pairs: bool = False


def decode_tiles(pool_dtype: torch.dtype, batch_size: int) -> DecodeTiles:
    """The tiles for a pool dtype and batch size, from H200 sweeps (benchmarks/bench_gpu_decode_attention.py
    --triton-sweep; docs/gpu.md, "Decode attention"): FP8 pools read V in pairs with 128-token
    tiles, except at batch 1, where byte reads of 32-token tiles are faster."""
    if pool_dtype == torch.float8_e4m3fn:
        return DecodeTiles(32, 4, 3) if batch_size == 1 else DecodeTiles(128, 4, 3, v_pairs=True)
    return DecodeTiles(64, 4, 2) if batch_size < 64 else DecodeTiles(64, 4, 3)


def paged_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int, sm_scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0, splits: int | None = None,
                 tiles: DecodeTiles | None = None, pdl: bool = True) -> torch.Tensor:
    """q [B, Hq, D] (bf16/fp16) against the pool k_buf, v_buf [Hkv, slots, D] -> [B, Hq, D]; the
    pool in q's dtype or FP8 e4m3 with its K and V scales. tiles: decode_tiles' when None.

    An FP8 pool is widened to fp16, not to the query's bf16: e4m3 -> fp16 is one instruction per
    two values on Hopper, while e4m3 -> bf16 goes through fp32 and its conversions capped long
    contexts at ~2.2 TB/s. The query is scaled (sm_scale * k_scale * log2 e) before it is cast
    to fp16, so scores leave the dot scaled and a query would need |q| * scale > 65504 to
    overflow; fp16 holds e4m3 values exactly and keeps 3 more mantissa bits than bf16 for the
    query and the probabilities. A bf16 or fp16 pool is read in its own dtype.

    With tiles.v_pairs an FP8 pool's V is read as 16-bit words, each two neighbouring e4m3 values,
    and multiplied as two halves (even and odd columns). Read as bytes, V [tokens, D] feeds the
    P.V product as its B operand with the reduced dimension (tokens) across rows, so Triton stages
    it for 8-byte copies and gathers it from shared memory one byte at a time (128 ld.shared.b8 a
    thread per 128-token tile); as 16-bit words it is copied 16 bytes at a time and transposed by
    ldmatrix (faster at every batch but 1: decode_tiles). Each word is then split and widened by
    _e4m3_pair_half_to_fp16."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"paged_decode: {num_q_heads} query heads for {num_kv_heads} KV heads")
    if k_buf.stride(2) != 1 or k_buf.stride(1) != head_dim or v_buf.stride(1) != head_dim:
        raise ValueError("paged_decode: the pool must be [Hkv, slots, D] with contiguous rows")
    group = num_q_heads // num_kv_heads
    tiles = tiles or decode_tiles(k_buf.dtype, batch)
    v_pairs = tiles.v_pairs and k_buf.dtype == torch.float8_e4m3fn
    if v_pairs and head_dim < 32:
        raise ValueError(f"paged_decode: V pairs need head_dim >= 32, got {head_dim}")
    if splits is None:
        splits = decode_num_splits(batch, num_kv_heads, _sm_count(q.device.index or 0) if q.is_cuda else 1)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if splits > 1:
        part_out = torch.empty((batch, splits, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, splits, num_q_heads), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    pdl = pdl_enabled(q, pdl)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_buf, v_buf, indptr, indices, last_page_len, out, part_out, part_lse, q.stride(0), q.stride(1),
        k_buf.stride(0), v_buf.stride(0), out.stride(0), out.stride(1), sm_scale * k_scale * _LOG2E, v_scale,
        WIDEN_FP16=k_buf.dtype == torch.float8_e4m3fn, NUM_Q_HEADS=num_q_heads, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_T=tiles.block_t, NUM_SPLITS=splits, V_PAIRS=v_pairs, PTX=_nvidia_ptx(q), PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
    if splits > 1:
        _merge_kernel[(batch, num_q_heads)](part_out, part_lse, out, out.stride(0), out.stride(1), v_scale,
                                           NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits, PDL=pdl,
                                           launch_pdl=pdl)
    return out
