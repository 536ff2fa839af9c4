"""Page tables for paged-attention kernels (CPU): they must name exactly each request's KV."""

from __future__ import annotations

import pytest
import torch

from radixlm.srt.executor.attention.paged_kv import as_pages
from radixlm.srt.executor.attention.paged_kv import build_paged_kv, qo_indptr_for
from radixlm.srt.scheduler.kv_memory import PageAllocator


def _tokens_from_pages(kv, pages: torch.Tensor, page_size: int, req: int) -> torch.Tensor:
    """What a paged kernel reads for request `req`: [Hkv, seq_len, D]."""
    ids = kv.indices[int(kv.indptr[req]):int(kv.indptr[req + 1])].long()
    gathered = pages[ids]  # [n_pages, Hkv, page_size, D]
    flat = gathered.permute(1, 0, 2, 3).reshape(pages.shape[1], -1, pages.shape[3])
    used = (len(ids) - 1) * page_size + int(kv.last_page_len[req])
    return flat[:, :used]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_tables_read_back_every_requests_kv(page_size):
    gen = torch.Generator().manual_seed(0)
    alloc = PageAllocator(capacity_tokens=512, page_size=page_size)
    num_slots = alloc.num_pages * page_size
    k_buf = torch.randn(2, num_slots, 8, generator=gen)  # head-major pool of one layer
    table = torch.zeros(6, 200, dtype=torch.int64)
    seq_lens = [1, 37, page_size, 64, 5]
    rows = [4, 0, 2, 5, 1]
    for row, n in zip(rows, seq_lens):
        # Two allocations per request, so pages are not contiguous and a page may be half full.
        first = n // 2
        slots = alloc.alloc(0, first, None) if first else []
        slots += alloc.alloc(first, n - first, slots[-1] if slots else None)
        table[row, :n] = torch.tensor(slots)
    kv = build_paged_kv(table, rows, seq_lens, page_size)
    assert kv.indptr.dtype == kv.indices.dtype == kv.last_page_len.dtype == torch.int32
    pages = as_pages(k_buf, page_size)
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        expected = k_buf[:, table[row, :n]]
        assert torch.equal(_tokens_from_pages(kv, pages, page_size, i), expected)


def test_padding_requests_read_one_token_of_the_padding_page():
    table = torch.arange(40, dtype=torch.int64).view(2, 20) + 8
    kv = build_paged_kv(table, [1], [9], page_size=4, pad_to=3)
    assert kv.indptr.tolist() == [0, 3, 4, 5]
    assert kv.last_page_len.tolist() == [1, 1, 1]
    assert kv.indices.tolist() == [7, 8, 9, 0, 0]
    with pytest.raises(ValueError, match="pad_to"):
        build_paged_kv(table, [0, 1], [3, 3], page_size=4, pad_to=1)


def test_qo_indptr():
    assert qo_indptr_for([3, 1, 5]).tolist() == [0, 3, 4, 9]


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_one_each_continues_pages_like_alloc(page_size):
    """The batched decode allocation takes the same slots as one `alloc` per request would."""
    seq_lens = [1, page_size, 2 * page_size + 1, 3]
    batched, single = PageAllocator(64, page_size), PageAllocator(64, page_size)
    lasts = []
    for n in seq_lens:  # identical histories: each request's first n tokens
        a, b = batched.alloc(0, n, None), single.alloc(0, n, None)
        assert a == b
        lasts.append(a[-1])
    got = batched.alloc_one_each(seq_lens, lasts)
    want = [single.alloc(n, 1, last)[0] for n, last in zip(seq_lens, lasts)]
    assert got == want and batched.available_size == single.available_size
    assert PageAllocator(2 * page_size, page_size).alloc_one_each([page_size] * 3, [0, 0, 0]) is None
