"""Page tables in the CSR form paged-attention kernels read: indptr, page indices, last-page lengths.

Built from the request-to-token table on the device with a fixed number of small kernels and
no host sync: the host only supplies sequence lengths it already knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    """Request i's pages are `indices[indptr[i]:indptr[i + 1]]`; its last page holds
    `last_page_len[i]` tokens. `indptr` and `last_page_len` stay on the host (kernels plan
    from them there); `indices` is on the table's device. All int32."""

    indptr: torch.Tensor  # [B + 1], cpu
    indices: torch.Tensor  # [indptr[-1]], device
    last_page_len: torch.Tensor  # [B], cpu


def build_paged_kv(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens_cpu: list[int],
                   page_size: int, pad_to: int | None = None) -> PagedKV:
    """Pages of each request's first `seq_lens_cpu[i]` tokens, in order.

    pad_to: append dummy requests (one token on page 0, the allocator's padding page) up to
    this batch size, for a CUDA graph captured at a larger batch.
    """
    num_pages = [-(-s // page_size) for s in seq_lens_cpu]
    num_pad = (pad_to - len(seq_lens_cpu)) if pad_to is not None else 0
    if num_pad < 0:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch ({len(seq_lens_cpu)})")
    counts = num_pages + [1] * num_pad
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, out=indptr[1:])
    last_page_len = torch.tensor([(s - 1) % page_size + 1 for s in seq_lens_cpu] + [1] * num_pad, dtype=torch.int32)
    total_real = int(indptr[len(seq_lens_cpu)])
    device = req_to_token.device
    pages_dev = torch.tensor(num_pages, dtype=torch.int64).to(device, non_blocking=True)
    # For every page: its request's table row and its first token's column.
    owner = torch.repeat_interleave(torch.arange(len(num_pages), device=device), pages_dev, output_size=total_real)
    starts = indptr[:len(num_pages)].to(device=device, dtype=torch.int64, non_blocking=True)
    page_in_req = torch.arange(total_real, device=device) - starts[owner]
    slots = req_to_token[req_pool_indices[owner], page_in_req * page_size]
    indices = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    if num_pad:
        indices = torch.cat([indices, torch.zeros(num_pad, dtype=torch.int32, device=device)])
    return PagedKV(indptr, indices, last_page_len)


def qo_indptr_for(extend_lens_cpu: list[int]) -> torch.Tensor:
    """Host int32 offsets of each request's new tokens in the flattened batch."""
    out = torch.zeros(len(extend_lens_cpu) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(extend_lens_cpu, dtype=torch.int32), 0, out=out[1:])
    return out
