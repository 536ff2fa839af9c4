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
  order (deterministic_kernels._merge). Sequentially, one program walks every segment and
  merges as it goes; split, a decode step computes each of a request's segments on its own
  (its own program, or every n-th in a graph's fixed grid) and a second kernel merges their
  partial results in the same order with the same arithmetic (FMA contraction off in both
  kernels, so each operation rounds alike). Either way a row's bits depend only on its own
  keys: split mode is what makes a batch-1 decode step fill the GPU.

Tables (int32, on the device): request r's new tokens are q rows q_indptr[r]:q_indptr[r + 1],
its keys' slots slots[kv_indptr[r]:kv_indptr[r + 1]] in position order (its new tokens last);
tile i holds request tile_req[i]'s new tokens from tile_tok[i] on, tokens_per_tile of them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton

from .cascade_groups import find_groups
from . import deterministic_kernels as kernels
from .layer_spec import LayerAttention
from ..pinned_ring import PinnedRing

BLOCK_M = 64  # query rows per program: tokens x group heads
KEY_BLOCK = 64
SEGMENT = 256  # keys per segment (a multiple of KEY_BLOCK): a split decode's program each
NUM_STAGES = 2
# A decode-only call of fewer programs than this (tiles x KV heads) runs split, when its partial
# results fit SPLIT_WORKSPACE_BYTES; more programs fill the GPU without splitting.
SPLIT_BELOW_PROGRAMS = 256
SPLIT_WORKSPACE_BYTES = 64 << 20
CASCADE_WORKSPACE_BYTES = 256 << 20  # a cascade step's partial results, at most
# The cascade kernel's programs per KV head: each takes every CASCADE_PROGRAMS-th (group tile,
# shared segment) pair, so a graph's fixed grid covers any number of them.
CASCADE_PROGRAMS = 64
_LOG2E = 1.4426950408889634


class Tables(NamedTuple):
    """One forward's tables on the device (see the module docstring); num_tiles programs per KV
    head; with segments > 0 (decode only) the call runs split: room for that many partial results
    per (tile, query head) in part_acc and part_ml (split_partials), and split_programs segment
    programs per tile (0: segments; fewer than a tile's segments each take every
    split_programs-th). A cascade step (cascade_if_worth_it) adds group tiles: group_members
    (MEMBERS request indices per group tile, -1 for none), cascade_items (a (group tile, shared
    segment) pair per segment they share, cascade_count of them, counted on the device so a
    graph can replay any number), cascade_programs > 0, and tile_skip telling each member's
    split programs how many leading segments the cascade kernel computed for it."""

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
    cascade_items: torch.Tensor | None = None
    cascade_count: torch.Tensor | None = None
    cascade_programs: int = 0  # the cascade kernel's programs per KV head; 0: not a cascade step


def split_segments(num_tiles: int, num_heads: int, num_kv_heads: int, head_dim: int, longest: int) -> int:
    """Segment programs per tile for a decode-only call of num_tiles requests whose longest has
    `longest` keys; 0 (run it sequentially) when it has programs enough without splitting, one
    segment, or partial results over SPLIT_WORKSPACE_BYTES. Either way gives the same bits."""
    segments = -(-longest // SEGMENT)
    if segments < 2 or num_tiles * num_kv_heads * _chunks(num_heads // num_kv_heads) >= SPLIT_BELOW_PROGRAMS:
        return 0
    return segments if split_partials_floats(num_tiles, num_heads, head_dim, segments) * 4 <= SPLIT_WORKSPACE_BYTES else 0


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


def cascade_plan(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], group: int):
    """(members, segments, skip, saved keys) for a decode step whose requests share whole
    segments of slots (the radix cache's same few-shot prefix or system prompt), or None: group
    tiles of up to tokens_per_tile requests, each tile's shared segment count, each request's
    count to skip, and how many key positions per KV head are not read again."""
    per_tile = tokens_per_tile(group)  # a cascade tile's rows: one decode token per request
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
    if split_partials_floats(tables.num_tiles, num_heads, head_dim, total) * 4 > CASCADE_WORKSPACE_BYTES:
        return tables
    own = max(-(-n // SEGMENT) - s for n, s in zip(seq_lens, skip))
    items = cascade_items(shared)
    members_t, items_t, count_t, skip_t = upload(
        [np.asarray(xs, dtype=np.int64) for xs in (members, items, [len(items) // 2], skip)], tables.slots.device)
    part_acc, part_ml = split_partials(tables.num_tiles, num_heads, head_dim, total, tables.slots.device)
    return tables._replace(segments=total, part_acc=part_acc, part_ml=part_ml, split_programs=own, tile_skip=skip_t,
                           group_members=members_t, cascade_items=items_t, cascade_count=count_t,
                           cascade_programs=min(len(items) // 2, CASCADE_PROGRAMS))


def cascade_items(shared: list[int]) -> list[int]:
    """The (group tile, shared segment) pairs of group tiles sharing shared[t] segments each,
    flattened."""
    return [x for tile, count in enumerate(shared) for seg in range(count) for x in (tile, seg)]


def split_partials_floats(num_tiles: int, num_heads: int, head_dim: int, segments: int) -> int:
    return num_tiles * num_heads * segments * (triton.next_power_of_2(head_dim) + 2)


def _chunks(group: int) -> int:
    return -(-group // min(group, BLOCK_M))


def tokens_per_tile(group: int) -> int:
    return BLOCK_M // min(group, BLOCK_M)


def num_warps(head_dim: int) -> int:
    """Fixed per head size (never per call): 8 warps keep a 256-wide accumulator in registers."""
    return 4 if head_dim <= 128 else 8


def host_tables(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int],
                group: int) -> list[np.ndarray]:
    """(q_indptr, kv_indptr, slots, tile_req, tile_tok) as host arrays for requests at table rows
    `rows`; each request's tiles cover its new tokens in order (upload makes them int32)."""
    per_tile = tokens_per_tile(group)
    table = req_to_token.numpy()
    new = np.asarray(extend_lens, dtype=np.int64)
    q_indptr = np.zeros(len(new) + 1, dtype=np.int64)
    np.cumsum(new, out=q_indptr[1:])
    kv_indptr = np.zeros(len(new) + 1, dtype=np.int64)
    np.cumsum(np.asarray(seq_lens, dtype=np.int64), out=kv_indptr[1:])
    tiles = -(-new // per_tile)
    tile_req = np.repeat(np.arange(len(new)), tiles)
    first_tile = np.cumsum(tiles) - tiles  # each request's first tile's index
    tile_tok = (np.arange(int(tiles.sum())) - np.repeat(first_tile, tiles)) * per_tile
    slots = [table[row, :n] for row, n in zip(rows, seq_lens)]
    flat = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    return [q_indptr, kv_indptr, flat, tile_req, tile_tok]


def load_tables(host: list[np.ndarray], device: torch.device) -> Tables:
    """host_tables' arrays on `device`, as Tables."""
    return Tables(*upload(host, device), num_tiles=int(host[3].size))


_rings: dict[torch.device, PinnedRing] = {}


def upload(host: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host integer arrays as int32 tensors on `device`, in one copy from pinned memory on CUDA
    (pinned_ring.py: it queues behind the running step instead of waiting for it)."""
    return staging_ring(device).upload(host)


def staging_ring(device: torch.device) -> PinnedRing:
    """The ring upload() copies through on `device` (for tables copied into fixed addresses)."""
    device = torch.device(device)
    if device not in _rings:
        _rings[device] = PinnedRing(device)
    return _rings[device]


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
    if tables.cascade_programs:
        kernels.cascade_kernel[(tables.cascade_programs, num_kv_heads)](
            q, k_buf, v_buf, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.slots, tables.group_members,
            tables.cascade_items, tables.cascade_count, q.stride(0), q.stride(1), k_buf.stride(0), v_buf.stride(0), qk_scale,
            float(softcap or 1.0), num_heads, segments,
            GROUP=group, HEADS_PER_TILE=heads_per_tile, CHUNKS=chunks, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=BLOCK_M, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT, SOFTCAP=softcap is not None, PRECISION=precision,
            num_warps=num_warps(head_dim), num_stages=NUM_STAGES, enable_fp_fusion=False)
    skip = tables.tile_skip is not None
    # No FMA contraction: a split row's merges run in the combine kernel, a sequential row's in
    # this one, and each operation must round alike in both.
    kernels.attend_kernel[(tables.num_tiles, num_kv_heads * chunks, max(tables.split_programs or segments, 1))](
        q, k_buf, v_buf, out, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.slots, tables.tile_req,
        tables.tile_tok, tables.tile_skip if skip else tables.tile_tok, q.stride(0), q.stride(1), k_buf.stride(0),
        v_buf.stride(0), out.stride(0), qk_scale, v_scale, float(softcap or 1.0), window, num_heads, segments,
        GROUP=group, HEADS_PER_TILE=heads_per_tile, CHUNKS=chunks, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=BLOCK_M, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT, SPLIT=segments > 0, SKIP=skip,
        SOFTCAP=softcap is not None, WINDOW=spec.sliding_window is not None, PRECISION=precision,
        num_warps=num_warps(head_dim), num_stages=NUM_STAGES, enable_fp_fusion=False)
    if segments:
        kernels.combine_kernel[(tables.num_tiles, num_heads)](
            out, part_acc, part_ml, tables.q_indptr, tables.kv_indptr, tables.tile_req, out.stride(0), v_scale, window,
            num_heads, segments, HEAD_DIM=head_dim, BLOCK_D=block_d, KEY_BLOCK=KEY_BLOCK, SEGMENT=SEGMENT,
            WINDOW=spec.sliding_window is not None, num_warps=1, enable_fp_fusion=False)
    return out
