"""Cascade-attention groups: one-token requests of a batch that hold the same KV slots for a
long prefix (the radix cache hands requests on the same few-shot prefix or system prompt the
very same slots), so the prefix can be attended once per group instead of once per request.

Shared by the torch-native and FlashInfer backends; host-side numpy only, no device work.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Requests sharing fewer KV slots than this are attended one by one (no cascade).
CASCADE_MIN_PREFIX = 64


@dataclass(frozen=True)
class CascadeGroup:
    members: list[int]  # batch indices, ascending
    prefix_len: int  # leading KV slots every member holds (a multiple of page_size)


@dataclass(frozen=True)
class CascadeGroups:
    groups: list[CascadeGroup]  # in order of each group's first member
    prefix_lens: list[int]  # per request: its group's prefix_len, 0 outside every group

    @property
    def saved_tokens(self) -> int:
        """KV tokens per layer a cascade step does not read: each group's prefix is read once,
        not once per member."""
        return sum((len(g.members) - 1) * g.prefix_len for g in self.groups)


def find_groups(table: torch.Tensor | np.ndarray, rows: Sequence[int], seq_lens: Sequence[int],
                min_prefix: int = CASCADE_MIN_PREFIX, page_size: int = 1) -> CascadeGroups | None:
    """Groups requests that share at least `min_prefix` KV slots; None when none do.

    Request i's slots are `table[rows[i], :seq_lens[i]]` (a host int64 table). A cached slot's
    KV depends on every token before it, so requests holding the same slot at position
    `min_prefix - 1` share all the slots up to it: that slot is the grouping key. A group's
    prefix is then the longest run of slots all its members share, less the newest token of
    its shortest member (every request keeps at least one token of its own), rounded down to
    a multiple of `page_size` (a paged kernel cannot start a request's KV mid-page).
    """
    slots = table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
    key_pos = min_prefix - 1
    if key_pos < 0 or slots.shape[1] <= key_pos:
        return None
    eligible = [i for i, n in enumerate(seq_lens) if n > min_prefix]
    if len(eligible) < 2:
        return None
    row_of = np.asarray(rows, dtype=np.int64)
    by_key: dict[int, list[int]] = defaultdict(list)
    for i, key in zip(eligible, slots[row_of[eligible], key_pos].tolist()):
        by_key[key].append(i)
    prefix_lens = [0] * len(seq_lens)
    groups = []
    for members in by_key.values():
        if len(members) < 2:
            continue
        limit = min(seq_lens[i] for i in members) - 1
        member_rows = row_of[members]
        same = (slots[member_rows[1:], :limit] == slots[member_rows[0], :limit]).all(axis=0)
        shared = limit if bool(same.all()) else int(same.argmin())
        shared -= shared % page_size
        if shared < min_prefix:
            continue
        groups.append(CascadeGroup(members, shared))
        for i in members:
            prefix_lens[i] = shared
    return CascadeGroups(groups, prefix_lens) if groups else None
