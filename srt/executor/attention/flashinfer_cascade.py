"""Page tables of cascade decode for the FlashInfer backend (see flashinfer_backend.py): level 1
attends each group's queries to its shared prefix pages, level 2 every request to its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cascade_groups import CascadeGroups
from .paged_kv import PagedKV, build_paged_kv, qo_indptr_for


@dataclass(frozen=True)
class CascadeTables:
    """Host page tables of one cascade decode step, in level order: each group's members in
    turn, then the ungrouped requests (`order[j]` is the batch index of level row j)."""

    order: list[int]
    num_grouped: int
    qo_indptr: torch.Tensor  # level 1: group g's queries are level rows [qo_indptr[g], qo_indptr[g + 1])
    shared: PagedKV  # level 1: group g's shared prefix pages
    own: PagedKV  # level 2: level row j's pages after its prefix (all of them outside groups)


def cascade_page_tables(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], found: CascadeGroups,
                        page_size: int) -> CascadeTables:
    order = [i for g in found.groups for i in g.members]
    num_grouped = len(order)
    order += [i for i, p in enumerate(found.prefix_lens) if p == 0]
    shared = build_paged_kv(req_to_token, [rows[g.members[0]] for g in found.groups],
                            [g.prefix_len for g in found.groups], page_size)
    own = build_paged_kv(req_to_token, [rows[i] for i in order], [seq_lens[i] for i in order], page_size,
                         starts=[found.prefix_lens[i] for i in order])
    return CascadeTables(order, num_grouped, qo_indptr_for([len(g.members) for g in found.groups]), shared, own)


@dataclass(frozen=True)
class CascadeStep:
    num_grouped: int  # the first num_grouped rows (in level order) belong to groups
    order: torch.Tensor | None  # [B] device: level order -> batch row; None when they are equal
    inverse: torch.Tensor | None  # [B] device: batch row -> level order
    decode: object  # level-2 wrapper
    prefix: object  # level-1 wrapper
    # CUDA graphs: level 1 runs over every row (rows outside groups see the padding page) and
    # only the grouped rows merge, by this mask, so no shape depends on the batch.
    merge_mask: torch.Tensor | None = None


@dataclass
class GraphCascade:
    """One decode bucket's cascade wrappers and reordering buffers (fixed addresses)."""

    decode: object
    prefix: object
    order: torch.Tensor
    inverse: torch.Tensor
    merge_mask: torch.Tensor


def graph_prefix_segments(padded_size: int) -> int:
    """Level-1 segments of a cascade graph: up to one group per four rows, plus one for every
    row outside the groups. Fixed per bucket (FlashInfer's graph-mode plan needs that); it also
    fixes the query tile at 128 rows, so a group's prefix is read once per group. Its split-KV
    scratch grows with it: a batch with more groups uses the plain graph."""
    return padded_size // 4 + 1


def graph_cascade_tables(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int],
                         found: CascadeGroups | None, page_size: int, padded_size: int):
    """Cascade page tables for a graph bucket of `padded_size` rows, every size fixed: level
    order is the groups' members, then the other requests, then padding rows; level 1 has one
    segment per group, then one holding every other row (on the padding page; those rows are
    masked out of the merge), then empty segments. Returns (order, num_grouped, qo_indptr,
    shared, own)."""
    groups = found.groups if found is not None else []
    prefix_lens = found.prefix_lens if found is not None else [0] * len(rows)
    order = [i for g in groups for i in g.members]
    num_grouped = len(order)
    order += [i for i, p in enumerate(prefix_lens) if p == 0]
    order += list(range(len(rows), padded_size))
    num_segments = graph_prefix_segments(padded_size)
    seg_lens = [len(g.members) for g in groups] + [padded_size - num_grouped]
    seg_lens += [0] * (num_segments - len(seg_lens))
    qo_indptr = qo_indptr_for(seg_lens)
    shared = build_paged_kv(req_to_token, [rows[g.members[0]] for g in groups], [g.prefix_len for g in groups],
                            page_size, pad_to=num_segments)
    real = order[:len(rows)]
    own = build_paged_kv(req_to_token, [rows[i] for i in real], [seq_lens[i] for i in real], page_size,
                         pad_to=padded_size, starts=[prefix_lens[i] for i in real])
    return order, num_grouped, qo_indptr, shared, own
