"""Batch-invariant paged attention in Triton: the CUDA attention of --enable-deterministic-inference.

A query's result must not depend on its batch, its companions, how its prompt was chunked, or
whether its prefix came from the cache; and a decode step and a prefill chunk must compute it
alike. So every call, decode or extend, runs one kernel of one configuration (BLOCK_M query rows,
KEY_BLOCK keys, NUM_WARPS, NUM_STAGES: no autotune, no split of the keys across programs):

- One program per (query tile of one request, KV head). A tile's rows are (query token, query
  head of the KV head's group) pairs; a decode step's tile holds its one token.
- The program walks the request's keys in blocks of KEY_BLOCK positions aligned to position 0,
  in position order, reading slots through the request's row of the token table, with an
  online softmax per row. Every product has the tile's fixed shape and each output element
  sums over head_dim and the keys in one order whatever the other rows hold.
- A block a row may not see at all (after it, before its window) leaves that row's (m, l, acc)
  bit-identical (m = -inf: alpha = 1, p = 0; else alpha = exp2(0) = 1, p = 0), so a tile that
  reaches further, or starts earlier, for other rows changes nothing for this one. Keys a row
  may not see inside a block it does see enter with weight exactly 0.

Tables (int32, on the device): request r's new tokens are q rows q_indptr[r]:q_indptr[r + 1],
its keys' slots slots[kv_indptr[r]:kv_indptr[r + 1]] in position order (its new tokens last);
tile i holds request tile_req[i]'s new tokens from tile_tok[i] on, tokens_per_tile of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .layer_spec import LayerAttention

BLOCK_M = 64  # query rows per program: tokens x group heads
KEY_BLOCK = 64
NUM_STAGES = 2
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_indptr_ptr, kv_indptr_ptr, slots_ptr, tile_req_ptr, tile_tok_ptr,
                   stride_qt, stride_qh, stride_kh, stride_vh, stride_ot, qk_scale, v_scale, softcap, window,
                   GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // CHUNKS
    chunk = tl.program_id(1) % CHUNKS
    req = tl.load(tile_req_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    q_start = tl.load(q_indptr_ptr + req)
    num_new = tl.load(q_indptr_ptr + req + 1) - q_start
    kv_start = tl.load(kv_indptr_ptr + req)
    seq_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
    prefix = seq_len - num_new

    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // HEADS_PER_TILE
    g = chunk * HEADS_PER_TILE + r % HEADS_PER_TILE
    row_ok = (r < TOKENS * HEADS_PER_TILE) & (tok < num_new) & (g < GROUP)
    pos = tl.where(row_ok, prefix + tok, -1)  # -1: a padding row sees no key
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

    last_pos = prefix + tl.minimum(tok0 + TOKENS, num_new) - 1  # the tile's last query
    lo = 0
    if WINDOW:
        lo = tl.maximum(prefix + tok0 - window + 1, 0) // KEY_BLOCK * KEY_BLOCK  # aligned: same blocks for a row
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, last_pos + 1, KEY_BLOCK):
        kp = start + tl.arange(0, KEY_BLOCK)
        k_ok = kp <= last_pos
        slot = tl.load(slots_ptr + kv_start + kp, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # cap * tanh(s / cap), from exp2 (the interpreter has no tanh), then log2 domain
            x = s / softcap
            t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = tl.where(x < 0, -th, th) * softcap * 1.4426950408889634
        seen = kp[None, :] <= pos[:, None]
        if WINDOW:
            seen = seen & (kp[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        unseen = m_new == float("-inf")  # nothing seen yet: keep (m, l, acc) as they are
        m_ref = tl.where(unseen, 0.0, m_new)  # finite, so no -inf - -inf
        alpha = tl.where(unseen, 1.0, tl.exp2(m_i - m_ref))
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    scale = v_scale / tl.where(l_i > 0, l_i, 1.0)
    out_rows = out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * HEAD_DIM
    tl.store(out_rows[:, None] + d[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


class Tables(NamedTuple):
    """One forward's tables on the device (see the module docstring); num_tiles programs per KV head."""

    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    slots: torch.Tensor
    tile_req: torch.Tensor
    tile_tok: torch.Tensor
    num_tiles: int


def tokens_per_tile(group: int) -> int:
    return BLOCK_M // min(group, BLOCK_M)


def num_warps(head_dim: int) -> int:
    """Fixed per head size (never per call): 8 warps keep a 256-wide accumulator in registers."""
    return 4 if head_dim <= 128 else 8


def host_tables(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int],
                group: int) -> list[torch.Tensor]:
    """(q_indptr, kv_indptr, slots, tile_req, tile_tok) as host int32 tensors for requests at
    table rows `rows`; each request's tiles cover its new tokens in order."""
    per_tile = tokens_per_tile(group)
    table = req_to_token.numpy()
    q_indptr = [0]
    kv_indptr = [0]
    tile_req, tile_tok = [], []
    for i, (n, new) in enumerate(zip(seq_lens, extend_lens)):
        q_indptr.append(q_indptr[-1] + new)
        kv_indptr.append(kv_indptr[-1] + n)
        for t in range(0, new, per_tile):
            tile_req.append(i)
            tile_tok.append(t)
    slots = [torch.from_numpy(table[row, :n]) for row, n in zip(rows, seq_lens)]
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    flat = torch.cat(slots).to(torch.int32) if slots else torch.zeros(0, dtype=torch.int32)
    return [as_int(q_indptr), as_int(kv_indptr), flat, as_int(tile_req), as_int(tile_tok)]


def load_tables(host: list[torch.Tensor], device: torch.device) -> Tables:
    """host_tables' tensors on `device` in one copy (from pinned memory on CUDA, so it queues
    behind the running step instead of waiting for it)."""
    both = torch.cat(host)
    if device.type == "cuda":
        both = both.pin_memory()
    both = both.to(device, non_blocking=True)
    parts = both.split([t.numel() for t in host])
    return Tables(*parts, num_tiles=host[3].numel())


def attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, tables: Tables, sm_scale: float,
           spec: LayerAttention = LayerAttention(), k_scale: float = 1.0, v_scale: float = 1.0,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (bf16, fp16 or float32) against the pool k_buf, v_buf [Hkv, slots, D] (q's
    dtype, or FP8 e4m3 read times k_scale / v_scale) -> [T, Hq * D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"deterministic attention: {num_heads} query heads for {num_kv_heads} KV heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_buf.stride(2) != 1 or k_buf.stride(1) != head_dim or v_buf.stride(1) != head_dim:
        raise ValueError("deterministic attention: the pool must be [Hkv, slots, D] with contiguous rows")
    group = num_heads // num_kv_heads
    heads_per_tile = min(group, BLOCK_M)
    chunks = -(-group // heads_per_tile)
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    if num_tokens == 0 or tables.num_tiles == 0:
        return out
    softcap = spec.logit_softcap
    qk_scale = sm_scale * k_scale * (1.0 if softcap else _LOG2E)  # the softcap path goes to log2 after tanh
    _attend_kernel[(tables.num_tiles, num_kv_heads * chunks)](
        q, k_buf, v_buf, out, tables.q_indptr, tables.kv_indptr, tables.slots, tables.tile_req, tables.tile_tok,
        q.stride(0), q.stride(1), k_buf.stride(0), v_buf.stride(0), out.stride(0), qk_scale, v_scale,
        float(softcap or 1.0), int(spec.sliding_window or 0),
        GROUP=group, HEADS_PER_TILE=heads_per_tile, CHUNKS=chunks, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=BLOCK_M, KEY_BLOCK=KEY_BLOCK,
        SOFTCAP=softcap is not None, WINDOW=spec.sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps(head_dim), num_stages=NUM_STAGES)
    return out
