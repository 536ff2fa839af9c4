"""Page tables in the CSR form paged-attention kernels read: indptr, page indices, last-page lengths.

Built on the host from the request-to-token table (which lives there, see ReqToTokenTable):
one numpy slice per request, so a decode step of hundreds of requests costs well under a
millisecond and no device sync. The kernels' wrappers copy them to the device when planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedKV:
    """Request i's pages are `indices[indptr[i]:indptr[i + 1]]`; its last page holds
    `last_page_len[i]` tokens. Host int32 tensors."""

    indptr: torch.Tensor  # [B + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [B]


def build_paged_kv(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], page_size: int,
                   pad_to: int | None = None, starts: list[int] | None = None) -> PagedKV:
    """Pages of request i's first `seq_lens[i]` tokens (table row `rows[i]`), in order.

    pad_to: append dummy requests (one token on page 0, the allocator's padding page) up to
    this batch size, for a CUDA graph captured at a larger batch.
    starts: leave out each request's first `starts[i]` tokens (multiples of page_size; a
    cascade step reads them as a group's shared prefix): pages of tokens [starts[i], seq_lens[i]).
    """
    num_pad = (pad_to - len(seq_lens)) if pad_to is not None else 0
    if num_pad < 0:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch ({len(seq_lens)})")
    if starts is None:
        starts = [0] * len(seq_lens)
    elif any(s % page_size for s in starts):
        raise ValueError(f"starts must be multiples of page_size={page_size}")
    table = req_to_token.numpy()
    # The first slot of each page names the page (a page's slots are consecutive).
    parts = [table[row, s:n:page_size] for row, s, n in zip(rows, starts, seq_lens)]
    parts.append(np.zeros(num_pad, dtype=np.int64))
    slots = np.concatenate(parts)
    pages = slots if page_size == 1 else slots // page_size
    lens = [n - s for n, s in zip(seq_lens, starts)]
    counts = np.fromiter(((n + page_size - 1) // page_size for n in lens), dtype=np.int32, count=len(lens))
    indptr = np.zeros(len(lens) + num_pad + 1, dtype=np.int32)
    np.cumsum(np.concatenate([counts, np.ones(num_pad, dtype=np.int32)]), out=indptr[1:])
    last = np.fromiter(((n - 1) % page_size + 1 for n in lens), dtype=np.int32, count=len(lens))
    last_page_len = np.concatenate([last, np.ones(num_pad, dtype=np.int32)])
    return PagedKV(torch.from_numpy(indptr), torch.from_numpy(pages.astype(np.int32)), torch.from_numpy(last_page_len))


def qo_indptr_for(extend_lens_cpu: list[int]) -> torch.Tensor:
    """Host int32 offsets of each request's new tokens in the flattened batch."""
    out = torch.zeros(len(extend_lens_cpu) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(extend_lens_cpu, dtype=torch.int32), 0, out=out[1:])
    return out


def as_pages(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """[Hkv, slots, D] -> [num_pages, Hkv, page_size, D] as a strided view (no copy)."""
    num_kv_heads, num_slots, head_dim = buf.shape
    return buf.view(num_kv_heads, num_slots // page_size, page_size, head_dim).permute(1, 0, 2, 3)
