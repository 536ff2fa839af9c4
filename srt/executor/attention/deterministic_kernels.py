"""The Triton kernels of the deterministic attention (deterministic_triton.py plans their tables
and launches them; its docstring says what they compute and why a row's bits never depend on
its batch). Every size is a constexpr argument, so the launcher's constants rule alone.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, slots_ptr,
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
    if SPLIT:  # each segment on its own; their partial results go to the combine kernel
        first = seg_lo
        if SKIP:  # the segments a cascade program computed for the tile's group (cascade_kernel)
            seg_lo += tl.load(tile_skip_ptr + tile)
        # This program's segments: every num_programs(2)-th (one each when the grid has a
        # program per segment; a graph's fixed grid may have fewer). Past the end: none.
        for seg in range(seg_lo + tl.program_id(2), seg_hi, tl.num_programs(2)):
            m_i, l_i, acc = _segment(q, k_head, v_head, slots_ptr, kv_start, seg, lo, last_pos, pos, window,
                                     qk_scale, softcap, d, d_ok, BLOCK_M, BLOCK_D, HEAD_DIM, KEY_BLOCK, SEGMENT,
                                     SOFTCAP, WINDOW, PRECISION)
            part = (tile * num_heads + head).to(tl.int64) * num_segments + seg - first
            _store_partial(part_acc_ptr, part_ml_ptr, part, row_ok, m_i, l_i, acc, d, d_ok, BLOCK_D)
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
def cascade_kernel(q_ptr, k_ptr, v_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, slots_ptr,
                   group_members_ptr, items_ptr, num_items_ptr, stride_qt, stride_qh, stride_kh, stride_vh, qk_scale,
                   softcap, num_heads, num_segments,
                   GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr, SEGMENT: tl.constexpr,
                   SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """A decode step's segments that a group of requests share (the same slots, handed out by
    the radix cache): per (group tile, shared segment) pair and KV head, the segment's keys are
    read once for the stacked query rows of up to MEMBERS requests, and each row's partial
    result is stored where the split attend_kernel would have put it (it skips these segments).
    Program p takes pairs p, p + num_programs, ... of the *num_items_ptr listed. A row's products
    and sums are those of its own split program: the same _segment on a tile of the same shape,
    whose other rows never enter its bits."""
    kv_head = tl.program_id(1) // CHUNKS
    chunk = tl.program_id(1) % CHUNKS
    MEMBERS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    r = tl.arange(0, BLOCK_M)
    g = chunk * HEADS_PER_TILE + r % HEADS_PER_TILE
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    for item in range(tl.program_id(0), tl.load(num_items_ptr), tl.num_programs(0)):
        group_tile = tl.load(items_ptr + 2 * item)
        seg = tl.load(items_ptr + 2 * item + 1)
        member = tl.load(group_members_ptr + group_tile * MEMBERS + r // HEADS_PER_TILE,
                         mask=r < MEMBERS * HEADS_PER_TILE, other=-1)  # -1: no request
        row_ok = (member >= 0) & (g < GROUP)
        req = tl.where(row_ok, member, 0)  # a decode step: tile i is request i, its one query
        q_row = tl.load(q_indptr_ptr + req)
        kv_end = tl.load(kv_indptr_ptr + req + 1)
        pos = tl.where(row_ok, kv_end - tl.load(kv_indptr_ptr + req) - 1, -1)
        q = tl.load(q_ptr + q_row.to(tl.int64)[:, None] * stride_qt + (head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # Every member holds the same slots here: read them from the first member's row.
        kv_start = tl.load(kv_indptr_ptr + tl.load(group_members_ptr + group_tile * MEMBERS))
        last_pos = seg * SEGMENT + SEGMENT - 1  # the whole segment: every member sees all of it
        m_i, l_i, acc = _segment(q, k_head, v_head, slots_ptr, kv_start, seg, 0, last_pos, pos, 0, qk_scale, softcap,
                                 d, d_ok, BLOCK_M, BLOCK_D, HEAD_DIM, KEY_BLOCK, SEGMENT, SOFTCAP, False, PRECISION)
        part = (req * num_heads + head).to(tl.int64) * num_segments + seg
        _store_partial(part_acc_ptr, part_ml_ptr, part, row_ok, m_i, l_i, acc, d, d_ok, BLOCK_D)


@triton.jit
def combine_kernel(out_ptr, part_acc_ptr, part_ml_ptr, q_indptr_ptr, kv_indptr_ptr, tile_req_ptr, stride_ot,
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
