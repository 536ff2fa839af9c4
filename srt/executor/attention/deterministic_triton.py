"""Batch-invariant paged attention in Triton: the CUDA attention of --enable-deterministic-inference.

A query's result must not depend on its batch, its companions, how its prompt was chunked, or
whether its prefix came from the cache; and a decode step and a prefill chunk must compute it
alike. So every call, decode or extend, runs one kernel of one configuration (BLOCK_M query rows,
KEY_BLOCK keys, SEGMENT keys a segment, NUM_WARPS, NUM_STAGES: no autotune, no split that
depends on the batch):

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
- The keys fall into segments of SEGMENT positions, also aligned to position 0. Each segment
  starts a fresh online softmax, and a row's result merges its segments' (m, l, acc) in position
  order (_merge). Sequentially, one program walks every segment and merges as it goes; split, a
  decode step with few programs gives each of a request's segments its own program and a second
  kernel merges their partial results in the same order with the same arithmetic (FMA
  contraction off in both kernels, so each operation rounds alike). Either way a row's bits
  depend only on its own keys: split mode is what makes a batch-1 decode step fill the GPU.

Tables (int32, on the device): request r's new tokens are q rows q_indptr[r]:q_indptr[r + 1],
its keys' slots slots[kv_indptr[r]:kv_indptr[r + 1]] in position order (its new tokens last);
tile i holds request tile_req[i]'s new tokens from tile_tok[i] on, tokens_per_tile of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .cascade_groups import find_groups
from .layer_spec import LayerAttention

BLOCK_M = 64  # query rows per program: tokens x group heads
KEY_BLOCK = 64
SEGMENT = 256  # keys per segment (a multiple of KEY_BLOCK): a split decode's program each
NUM_STAGES = 2
# A decode-only call of fewer programs than this (tiles x KV heads) runs split, when its partial
# results fit SPLIT_WORKSPACE_BYTES; more programs fill the GPU without splitting.
SPLIT_BELOW_PROGRAMS = 256
SPLIT_WORKSPACE_BYTES = 64 << 20
CASCADE_WORKSPACE_BYTES = 256 << 20  # a cascade step's partial results, at most
_LOG2E = 1.4426950408889634


@triton.jit
def _merge(big_m, big_l, big_acc, m, l, acc):
    """(M, L, ACC) followed by one more segment's (m, l, acc), per row; m must be finite."""
    m_new = tl.maximum(big_m, m)
    a = tl.exp2(big_m - m_new)  # M = -inf (nothing merged yet): 0
    b = tl.exp2(m - m_new)
    return m_new, big_l * a + l * b, big_acc * a[:, None] + acc * b[:, None]


@triton.jit
def _window_lo(first_pos, window, KEY_BLOCK: tl.constexpr):
    """The first key block a query at first_pos sees through its window (aligned: the same
    blocks for a row whatever tile or kernel computes it)."""
    return tl.maximum(first_pos - window + 1, 0) // KEY_BLOCK * KEY_BLOCK


@triton.jit
def _normalized(big_acc, big_l, v_scale):
    """A row's output from its merged accumulator and sum (0 where it saw nothing)."""
    return big_acc * (v_scale / tl.where(big_l > 0, big_l, 1.0))[:, None]


@triton.jit
def _segment(q, k_head, v_head, slots_ptr, kv_start, seg, lo, last_pos, pos, window, qk_scale, softcap, d, d_ok,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, KEY_BLOCK: tl.constexpr,
             SEGMENT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """One segment's (m, l, acc) per row of q: its keys from `lo` to last_pos walked in blocks in
    position order with an online softmax (both kernels call this, so a row's bits are the same
    whichever computes it)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(tl.maximum(seg * SEGMENT, lo), tl.minimum(seg * SEGMENT + SEGMENT, last_pos + 1), KEY_BLOCK):
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
    return m_i, l_i, acc


@triton.jit
def _store_partial(part_acc_ptr, part_ml_ptr, part, stored, m, l, acc, d, d_ok, BLOCK_D: tl.constexpr):
    """A split row's segment result, as the first merge of its row leaves it (_merge onto an empty
    state is exact, and both kernels take the same path)."""
    big_m, big_l, big_acc = _merge(tl.full(m.shape, float("-inf"), dtype=tl.float32), tl.zeros(m.shape, tl.float32),
                                   tl.zeros(acc.shape, tl.float32), m, l, acc)
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], big_acc, mask=stored[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + part * 2, big_m, mask=stored)
    tl.store(part_ml_ptr + part * 2 + 1, big_l, mask=stored)


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, slots_ptr,
                   tile_req_ptr, tile_tok_ptr, tile_skip_ptr, stride_qt, stride_qh, stride_kh, stride_vh, stride_ot,
                   qk_scale, v_scale, softcap, window, num_heads, num_segments,
                   GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr, SEGMENT: tl.constexpr,
                   SPLIT: tl.constexpr, SKIP: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                   PRECISION: tl.constexpr):
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
        lo = _window_lo(prefix + tok0, window, KEY_BLOCK)
    seg_lo = lo // SEGMENT
    seg_hi = last_pos // SEGMENT + 1
    if SPLIT:  # one segment, this program's; its partial result goes to the combine kernel
        first = seg_lo
        if SKIP:  # the segments a cascade program computed for the tile's group (_cascade_kernel)
            seg_lo += tl.load(tile_skip_ptr + tile)
        seg_lo += tl.program_id(2)
        seg_hi = tl.minimum(seg_hi, seg_lo + 1)
        m_i, l_i, acc = _segment(q, k_head, v_head, slots_ptr, kv_start, seg_lo, lo, last_pos, pos, window, qk_scale,
                                 softcap, d, d_ok, BLOCK_M, BLOCK_D, HEAD_DIM, KEY_BLOCK, SEGMENT, SOFTCAP, WINDOW,
                                 PRECISION)
        part = ((tile * num_heads + head).to(tl.int64) * num_segments + seg_lo - first)
        stored = row_ok & (r < tl.where(seg_lo < seg_hi, BLOCK_M, 0))  # past the request's segments: none
        _store_partial(part_acc_ptr, part_ml_ptr, part, stored, m_i, l_i, acc, d, d_ok, BLOCK_D)
    else:
        # The segments each row merges: those holding a key it sees (padding rows: none). A split
        # decode row sees every segment its program computes.
        row_last = tl.where(row_ok, pos // SEGMENT, -1)
        row_first = tl.zeros([BLOCK_M], dtype=tl.int32)
        if WINDOW:
            row_first = tl.maximum(pos - window + 1, 0) // SEGMENT
        big_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        big_l = tl.zeros([BLOCK_M], dtype=tl.float32)
        big_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for seg in range(seg_lo, seg_hi):
            m_i, l_i, acc = _segment(q, k_head, v_head, slots_ptr, kv_start, seg, lo, last_pos, pos, window, qk_scale,
                                     softcap, d, d_ok, BLOCK_M, BLOCK_D, HEAD_DIM, KEY_BLOCK, SEGMENT, SOFTCAP, WINDOW,
                                     PRECISION)
            sees = (seg >= row_first) & (seg <= row_last)
            merged_m, merged_l, merged_acc = _merge(big_m, big_l, big_acc, m_i, l_i, acc)
            big_m = tl.where(sees, merged_m, big_m)
            big_l = tl.where(sees, merged_l, big_l)
            big_acc = tl.where(sees[:, None], merged_acc, big_acc)
        out_rows = out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * HEAD_DIM
        tl.store(out_rows[:, None] + d[None, :], _normalized(big_acc, big_l, v_scale).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _cascade_kernel(q_ptr, k_ptr, v_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, slots_ptr,
                    group_members_ptr, group_segments_ptr, stride_qt, stride_qh, stride_kh, stride_vh, qk_scale,
                    softcap, num_heads, num_segments,
                    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr, SEGMENT: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """A decode step's segments that a group of requests share (the same slots, handed out by
    the radix cache): one program per (group tile, KV head, shared segment) reads the segment's
    keys once for the stacked query rows of up to MEMBERS requests, and stores each row's
    partial result where the split _attend_kernel would have (it skips these segments). A row's
    products and sums are those of its own split program: the same _segment on a tile of the
    same shape, whose other rows never enter its bits."""
    group_tile = tl.program_id(0)
    kv_head = tl.program_id(1) // CHUNKS
    chunk = tl.program_id(1) % CHUNKS
    seg = tl.program_id(2)
    if seg < tl.load(group_segments_ptr + group_tile):
        MEMBERS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
        r = tl.arange(0, BLOCK_M)
        member = tl.load(group_members_ptr + group_tile * MEMBERS + r // HEADS_PER_TILE,
                         mask=r < MEMBERS * HEADS_PER_TILE, other=-1)  # -1: no request
        g = chunk * HEADS_PER_TILE + r % HEADS_PER_TILE
        row_ok = (member >= 0) & (g < GROUP)
        req = tl.where(row_ok, member, 0)  # a decode step: tile i is request i, its one query
        q_row = tl.load(q_indptr_ptr + req)
        kv_end = tl.load(kv_indptr_ptr + req + 1)
        pos = tl.where(row_ok, kv_end - tl.load(kv_indptr_ptr + req) - 1, -1)
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + q_row.to(tl.int64)[:, None] * stride_qt + (head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # Every member holds the same slots here: read them from the first member's row.
        kv_start = tl.load(kv_indptr_ptr + tl.load(group_members_ptr + group_tile * MEMBERS))
        last_pos = seg * SEGMENT + SEGMENT - 1  # the whole segment: every member sees all of it
        m_i, l_i, acc = _segment(q, k_ptr + kv_head.to(tl.int64) * stride_kh, v_ptr + kv_head.to(tl.int64) * stride_vh,
                                 slots_ptr, kv_start, seg, 0, last_pos, pos, 0, qk_scale, softcap, d, d_ok, BLOCK_M,
                                 BLOCK_D, HEAD_DIM, KEY_BLOCK, SEGMENT, SOFTCAP, False, PRECISION)
        part = (req * num_heads + head).to(tl.int64) * num_segments + seg
        _store_partial(part_acc_ptr, part_ml_ptr, part, row_ok, m_i, l_i, acc, d, d_ok, BLOCK_D)


@triton.jit
def _combine_kernel(out_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, tile_req_ptr, stride_ot,
                    v_scale, window, num_heads, num_segments, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    KEY_BLOCK: tl.constexpr, SEGMENT: tl.constexpr, WINDOW: tl.constexpr):
    """A split decode row's result: its segments' partial results merged in position order, as
    the sequential kernel merges them."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q_row = tl.load(q_indptr_ptr + req)
    pos = tl.load(kv_indptr_ptr + req + 1) - tl.load(kv_indptr_ptr + req) - 1  # its one query's position
    lo = 0
    if WINDOW:
        lo = _window_lo(pos, window, KEY_BLOCK)
    count = pos // SEGMENT - lo // SEGMENT + 1
    d = tl.arange(0, BLOCK_D)
    one = tl.zeros([1], dtype=tl.int32)
    base = (tile * num_heads + head).to(tl.int64) * num_segments
    big_m = tl.full([1], float("-inf"), dtype=tl.float32)
    big_l = tl.zeros([1], dtype=tl.float32)
    big_acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for i in range(0, count):
        part = base + i + one
        m = tl.load(part_ml_ptr + part * 2)
        l = tl.load(part_ml_ptr + part * 2 + 1)
        acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :])
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc)
    out_row = out_ptr + q_row.to(tl.int64) * stride_ot + head * HEAD_DIM + one
    tl.store(out_row[:, None] + d[None, :], _normalized(big_acc, big_l, v_scale).to(out_ptr.dtype.element_ty),
             mask=(d < HEAD_DIM)[None, :])


class Tables(NamedTuple):
    """One forward's tables on the device (see the module docstring); num_tiles programs per KV
    head; with segments > 0 (decode only) the call runs split: room for that many partial results
    per (tile, query head) in part_acc and part_ml (split_partials), and split_programs segment
    programs per tile (0: segments). A cascade step (cascade_if_worth_it) adds group tiles:
    group_members (MEMBERS request indices per group tile, -1 for none), group_segments (the
    segments they share, which tile_skip tells each member's split programs to skip)."""

    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    slots: torch.Tensor
    tile_req: torch.Tensor
    tile_tok: torch.Tensor
    num_tiles: int
    segments: int = 0
    part_acc: torch.Tensor | None = None
    part_ml: torch.Tensor | None = None
    split_programs: int = 0
    tile_skip: torch.Tensor | None = None
    group_members: torch.Tensor | None = None
    group_segments: torch.Tensor | None = None
    num_group_tiles: int = 0
    shared_segments: int = 0  # the cascade kernel's segment programs per group tile


def split_segments(num_tiles: int, num_heads: int, num_kv_heads: int, head_dim: int, longest: int) -> int:
    """Segment programs per tile for a decode-only call of num_tiles requests whose longest has
    `longest` keys; 0 (run it sequentially) when it has programs enough without splitting, one
    segment, or partial results over SPLIT_WORKSPACE_BYTES. Either way gives the same bits."""
    segments = -(-longest // SEGMENT)
    if segments < 2 or num_tiles * num_kv_heads * _chunks(num_heads // num_kv_heads) >= SPLIT_BELOW_PROGRAMS:
        return 0
    return segments if _partial_floats(num_tiles, num_heads, head_dim, segments) * 4 <= SPLIT_WORKSPACE_BYTES else 0


def split_if_worth_it(tables: Tables, num_heads: int, num_kv_heads: int, head_dim: int, longest: int) -> Tables:
    """A decode-only call's tables, split (with fresh partial buffers) where split_segments says so."""
    segments = split_segments(tables.num_tiles, num_heads, num_kv_heads, head_dim, longest)
    if not segments:
        return tables
    part_acc, part_ml = split_partials(tables.num_tiles, num_heads, head_dim, segments, tables.slots.device)
    return tables._replace(segments=segments, part_acc=part_acc, part_ml=part_ml)


def split_partials(num_tiles: int, num_heads: int, head_dim: int, segments: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_acc, part_ml): room for each (tile, query head, segment)'s accumulator and (m, l)."""
    count = num_tiles * num_heads * segments
    return (torch.empty(count * triton.next_power_of_2(head_dim), dtype=torch.float32, device=device),
            torch.empty(count * 2, dtype=torch.float32, device=device))


def members_per_tile(group: int) -> int:
    """Requests whose decode rows one cascade program stacks (a tile's tokens, one per request)."""
    return tokens_per_tile(group)


def cascade_plan(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], group: int):
    """(members, segments, skip, saved keys) for a decode step whose requests share whole
    segments of slots (the radix cache's same few-shot prefix or system prompt), or None: group
    tiles of up to members_per_tile requests, each tile's shared segment count, each request's
    count to skip, and how many key positions per KV head are not read again."""
    per_tile = members_per_tile(group)
    if per_tile < 2:
        return None
    found = find_groups(req_to_token, rows, seq_lens, min_prefix=SEGMENT)
    if found is None:
        return None
    members, segments, saved = [], [], 0
    skip = [0] * len(rows)
    for grp in found.groups:
        shared = grp.prefix_len // SEGMENT
        for i in range(0, len(grp.members), per_tile):
            tile = grp.members[i:i + per_tile]
            members += tile + [-1] * (per_tile - len(tile))
            segments.append(shared)
            saved += (len(tile) - 1) * shared * SEGMENT
            for j in tile:
                skip[j] = shared
    return members, segments, skip, saved


def cascade_if_worth_it(tables: Tables, plan, seq_lens: list[int], num_heads: int, num_kv_heads: int,
                        head_dim: int, min_saved_keys: int) -> Tables:
    """A decode-only call's tables as a cascade step (split, with group tiles) when its requests
    share whole segments (`plan`: cascade_plan's) that save at least min_saved_keys key reads per
    KV head and the partial results fit CASCADE_WORKSPACE_BYTES; otherwise unchanged. Same bits
    either way."""
    if plan is None or plan[3] < min_saved_keys or _chunks(num_heads // num_kv_heads) != 1:
        return tables
    members, shared, skip, _ = plan
    total = -(-max(seq_lens) // SEGMENT)
    if _partial_floats(tables.num_tiles, num_heads, head_dim, total) * 4 > CASCADE_WORKSPACE_BYTES:
        return tables
    own = max(-(-n // SEGMENT) - s for n, s in zip(seq_lens, skip))
    device = tables.slots.device
    host = torch.tensor(members + shared + skip, dtype=torch.int32)
    both = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    members_t, shared_t, skip_t = both.split([len(members), len(shared), len(skip)])
    part_acc, part_ml = split_partials(tables.num_tiles, num_heads, head_dim, total, device)
    return tables._replace(segments=total, part_acc=part_acc, part_ml=part_ml, split_programs=own, tile_skip=skip_t,
                           group_members=members_t, group_segments=shared_t, num_group_tiles=len(shared),
                           shared_segments=max(shared))


def _partial_floats(num_tiles: int, num_heads: int, head_dim: int, segments: int) -> int:
    return num_tiles * num_heads * segments * (triton.next_power_of_2(head_dim) + 2)


def _chunks(group: int) -> int:
    return -(-group // min(group, BLOCK_M))


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
    chunks = _chunks(group)
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    if num_tokens == 0 or tables.num_tiles == 0:
        return out
    softcap = spec.logit_softcap
    qk_scale = sm_scale * k_scale * (1.0 if softcap else _LOG2E)  # the softcap path goes to log2 after tanh
    window = int(spec.sliding_window or 0)
    segments = tables.segments
    part_acc, part_ml = (tables.part_acc, tables.part_ml) if segments else (out, out)  # unused when sequential
    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if tables.num_group_tiles:
        _cascade_kernel[(tables.num_group_tiles, num_kv_heads, tables.shared_segments)](
            q, k_buf, v_buf, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.slots, tables.group_members,
            tables.group_segments, q.stride(0), q.stride(1), k_buf.stride(0), v_buf.stride(0), qk_scale,
            float(softcap or 1.0), num_heads, segments,
            GROUP=group, HEADS_PER_TILE=heads_per_tile, CHUNKS=chunks, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=BLOCK_M, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT, SOFTCAP=softcap is not None, PRECISION=precision,
            num_warps=num_warps(head_dim), num_stages=NUM_STAGES, enable_fp_fusion=False)
    skip = tables.tile_skip is not None
    # No FMA contraction: a split row's merges run in the combine kernel, a sequential row's in
    # this one, and each operation must round alike in both.
    _attend_kernel[(tables.num_tiles, num_kv_heads * chunks, max(tables.split_programs or segments, 1))](
        q, k_buf, v_buf, out, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.slots, tables.tile_req,
        tables.tile_tok, tables.tile_skip if skip else tables.tile_tok, q.stride(0), q.stride(1), k_buf.stride(0),
        v_buf.stride(0), out.stride(0), qk_scale, v_scale, float(softcap or 1.0), window, num_heads, segments,
        GROUP=group, HEADS_PER_TILE=heads_per_tile, CHUNKS=chunks, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=BLOCK_M, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT, SPLIT=segments > 0, SKIP=skip,
        SOFTCAP=softcap is not None, WINDOW=spec.sliding_window is not None, PRECISION=precision,
        num_warps=num_warps(head_dim), num_stages=NUM_STAGES, enable_fp_fusion=False)
    if segments:
        _combine_kernel[(tables.num_tiles, num_heads)](
            out, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.tile_req, out.stride(0), v_scale, window,
            num_heads, segments, HEAD_DIM=head_dim, BLOCK_D=block_d, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT,
            WINDOW=spec.sliding_window is not None, num_warps=1, enable_fp_fusion=False)
    return out
