"""Cascade decode attention (shared prefix read once per group) equals plain attention."""

from __future__ import annotations

import math

import pytest
import torch

from radixlm.srt.executor.attention import torch_native
from radixlm.srt.executor.attention.torch_native import TorchNativeBackend
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.mem_pool import KVPool

HKV, GROUP, D = 3, 3, 64


def _reference(q, pool, rows, seq_lens, table, scale):
    outs = []
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = table[row, :n]
        k = pool.k_buffers[0][:, slots].repeat_interleave(GROUP, dim=0)  # [H, n, D]
        v = pool.v_buffers[0][:, slots].repeat_interleave(GROUP, dim=0)
        qi = q[i].view(HKV * GROUP, 1, D)
        w = torch.softmax((qi @ k.transpose(-1, -2)) * scale, dim=-1)
        outs.append((w @ v).reshape(-1))
    return torch.stack(outs)


def test_cascade_matches_plain_attention_for_mixed_groups():
    torch.manual_seed(0)
    pool = KVPool(4096, 1, HKV, D, torch.float32, "cpu")
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    table = torch.zeros(8, 1024, dtype=torch.int64)
    shared_a = torch.randperm(4000)[:300]  # one long prefix shared by rows 0-2
    shared_b = torch.randperm(4000)[:100]  # another by rows 3-4; rows 5-6 share too little
    seq_lens = [310, 305, 340, 120, 101, 70, 75]
    for row, n in enumerate(seq_lens):
        own = torch.randint(0, 4096, (n,))
        if row <= 2:
            own[:300] = shared_a
        elif row <= 4:
            own[:100] = shared_b
        else:
            own[:20] = shared_a[:20]
        table[row, :n] = own
    rows = list(range(len(seq_lens)))
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(7, dtype=torch.int64), positions=torch.zeros(7),
        out_cache_loc=table[rows, [n - 1 for n in seq_lens]], req_pool_indices=torch.tensor(rows),
        req_pool_indices_cpu=rows, seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        prefix_lens_cpu=[n - 1 for n in seq_lens], extend_lens_cpu=[1] * 7, logit_rows=torch.arange(7))
    scale = 1 / math.sqrt(D)
    backend = TorchNativeBackend(pool, table, scale)
    backend.plan(batch)
    assert isinstance(backend._decode, torch_native._CascadePlan) and len(backend._decode.groups) == 2
    q = torch.randn(7, HKV * GROUP * D)
    # The new token's K/V: write what is already in its slot, so the pool is unchanged.
    last = batch.out_cache_loc
    k_new = pool.k_buffers[0][:, last].transpose(0, 1).clone()
    v_new = pool.v_buffers[0][:, last].transpose(0, 1).clone()
    got = backend.forward(q.view(7, -1, D), k_new, v_new, 0)
    want = _reference(q, pool, rows, seq_lens, table, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    # With cascade disabled, the plain path gives the same numbers.
    old = torch_native.CASCADE_MIN_PREFIX
    torch_native.CASCADE_MIN_PREFIX = 10**9
    try:
        backend.plan(batch)
        assert isinstance(backend._decode, torch_native._PlainDecode)
        plain = backend.forward(q.view(7, -1, D), k_new, v_new, 0)
    finally:
        torch_native.CASCADE_MIN_PREFIX = old
    torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-5)


def test_engine_outputs_unchanged_by_cascade(engine, monkeypatch):
    """Prompts on a shared few-shot prefix decode together (cascade on) exactly as without it."""
    prefix = "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(1, 12))
    prompts = [prefix + f"Q: What is {i} plus {i}?\nA:" for i in (20, 31, 42, 53)]
    params = {"temperature": 0, "max_new_tokens": 12}
    engine.generate(prompts[0], {"max_new_tokens": 0})  # cache the prefix: the batch shares its slots
    calls = []
    real_build = torch_native._CascadePlan.build
    monkeypatch.setattr(torch_native._CascadePlan, "build",
                        staticmethod(lambda *a: calls.append(real := real_build(*a)) or real))
    with_cascade = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert any(plan is not None for plan in calls)
    monkeypatch.setattr(torch_native, "CASCADE_MIN_PREFIX", 10**9)
    engine.flush_cache()
    without = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert with_cascade == without


def test_extend_batch_with_riding_decodes_matches_plain_attention():
    """An extend batch mixing one-token requests (decodes riding along, sharing a prefix) with
    a chunk over a cached prefix and a fresh prompt: every row equals causal attention."""
    torch.manual_seed(1)
    pool = KVPool(4096, 1, HKV, D, torch.float32, "cpu")
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    table = torch.zeros(8, 1024, dtype=torch.int64)
    shared = torch.randperm(4000)[:200]
    # (row, prefix_len, extend_len): two riders on a shared prefix, a chunk, a fresh prompt.
    layout = [(0, 250, 1), (1, 230, 1), (2, 50, 5), (3, 0, 4)]
    for row, prefix, new in layout:
        slots = torch.randint(1, 4096, (prefix + new,))
        if row <= 1:
            slots[:200] = shared
        table[row, :prefix + new] = slots
    rows = [r for r, _, _ in layout]
    seq_lens = [p + n for _, p, n in layout]
    total = sum(n for _, _, n in layout)
    out_loc = torch.cat([table[r, p:p + n] for r, p, n in layout])
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total),
        out_cache_loc=out_loc, req_pool_indices=torch.tensor(rows), req_pool_indices_cpu=rows,
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens, prefix_lens_cpu=[p for _, p, _ in layout],
        extend_lens_cpu=[n for _, _, n in layout], logit_rows=torch.arange(total))
    scale = 1 / math.sqrt(D)
    backend = TorchNativeBackend(pool, table, scale)
    backend.plan(batch)
    assert isinstance(backend._decode, torch_native._CascadePlan)
    q = torch.randn(total, HKV * GROUP, D)
    k_new = pool.k_buffers[0][:, out_loc].transpose(0, 1).clone()  # what the slots already hold
    v_new = pool.v_buffers[0][:, out_loc].transpose(0, 1).clone()
    got = backend.forward(q, k_new, v_new, 0)
    start = 0
    for row, prefix, new in layout:
        slots = table[row, :prefix + new]
        k = pool.k_buffers[0][:, slots].repeat_interleave(GROUP, dim=0)
        v = pool.v_buffers[0][:, slots].repeat_interleave(GROUP, dim=0)
        qi = q[start:start + new].transpose(0, 1)  # [H, new, D]
        scores = (qi @ k.transpose(-1, -2)) * scale
        causal = torch.arange(prefix + new)[None, :] <= torch.arange(prefix, prefix + new)[:, None]
        want = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        torch.testing.assert_close(got[start:start + new], want.transpose(0, 1).reshape(new, -1), rtol=1e-4, atol=1e-5)
        start += new


def test_find_groups_rounds_shared_prefix_down_to_pages():
    from radixlm.srt.executor.attention.cascade_groups import find_groups

    table = torch.arange(6 * 400, dtype=torch.int64).view(6, 400) + 10_000  # every slot distinct
    table[1, :100] = table[0, :100]  # rows 0-1 share 100 slots
    table[2, :70] = table[3, :70] = table[4, :70]  # rows 2-4 share 70
    seq_lens = [300, 250, 200, 71, 90, 300]  # row 3 (71 tokens) keeps its last token: limit 70
    found = find_groups(table, range(6), seq_lens)
    assert [(g.members, g.prefix_len) for g in found.groups] == [([0, 1], 100), ([2, 3, 4], 70)]
    assert found.prefix_lens == [100, 100, 70, 70, 70, 0]
    assert found.saved_tokens == 100 + 2 * 70
    found = find_groups(table, range(6), seq_lens, page_size=16)
    assert [(g.members, g.prefix_len) for g in found.groups] == [([0, 1], 96), ([2, 3, 4], 64)]
    found = find_groups(table, range(6), seq_lens, page_size=32)  # 70 -> 64; 100 -> 96
    assert [g.prefix_len for g in found.groups] == [96, 64]
    assert find_groups(table, range(6), seq_lens, page_size=128) is None  # nothing left of 64+ tokens
    # Table rows are picked through `rows`; one member too short to share 64 slots: no group.
    assert find_groups(table, [5, 1, 0], [300, 250, 300]).groups[0].members == [1, 2]
    assert find_groups(table, [0, 1], [300, 64]) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_page_tables_cover_each_request(page_size):
    """Level 1's shared pages followed by level 2's own pages are exactly each request's KV."""
    from radixlm.srt.executor.attention.cascade_groups import find_groups
    from radixlm.srt.executor.attention.flashinfer_cascade import cascade_page_tables
    from radixlm.srt.scheduler.kv_memory import PageAllocator

    alloc = PageAllocator(capacity_tokens=8192, page_size=page_size)
    table = torch.zeros(12, 1024, dtype=torch.int64)
    lens = {}
    row = 0
    for shared, contexts in [(300, [301, 340, 600]), (77, [78, 150])]:
        aligned = shared // page_size * page_size  # a partial page is each request's own copy
        base = alloc.alloc(0, aligned, None)
        for n in contexts:
            table[row, :n] = torch.tensor(base + alloc.alloc(aligned, n - aligned, None))
            lens[row] = n
            row += 1
    for n in (50, 500):  # ungrouped
        table[row, :n] = torch.tensor(alloc.alloc(0, n, None))
        lens[row] = n
        row += 1
    rows = [5, 0, 3, 1, 6, 4, 2]  # members interleaved with ungrouped requests
    seq_lens = [lens[r] for r in rows]
    found = find_groups(table, rows, seq_lens, page_size=page_size)
    assert [len(g.members) for g in found.groups] == [3, 2]
    assert [g.prefix_len for g in found.groups] == ([300, 77] if page_size == 1 else [288, 64])
    tables = cascade_page_tables(table, rows, seq_lens, found, page_size)
    assert sorted(tables.order) == list(range(len(rows))) and tables.num_grouped == 5
    assert tables.qo_indptr.tolist() == [0, 3, 5]

    def pages_of(kv, i):
        return kv.indices[int(kv.indptr[i]):int(kv.indptr[i + 1])].tolist(), int(kv.last_page_len[i])

    group_of = {m: g for g, grp in enumerate(found.groups) for m in grp.members}
    for j, i in enumerate(tables.order):
        own, last = pages_of(tables.own, j)
        pages = own
        if i in group_of:
            shared, shared_last = pages_of(tables.shared, group_of[i])
            assert shared_last == page_size  # a prefix ends on a page boundary
            assert j in range(int(tables.qo_indptr[group_of[i]]), int(tables.qo_indptr[group_of[i] + 1]))
            pages = shared + own
        slots = [p * page_size + k for p in pages for k in range(page_size)]
        slots = slots[:len(slots) - page_size + last]
        assert slots == table[rows[i], :seq_lens[i]].tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_cascade_tables_have_fixed_sizes_and_cover_each_request(page_size):
    """A cascade CUDA graph's tables: sizes fixed by the bucket, the groups' rows first (merged),
    every other row (requests outside groups, padding) in one level-1 segment on the padding
    page, and level 1 + level 2 still exactly each grouped request's KV."""
    from radixlm.srt.executor.attention.cascade_groups import find_groups
    from radixlm.srt.executor.attention.flashinfer_cascade import graph_cascade_tables, graph_prefix_segments
    from radixlm.srt.scheduler.kv_memory import PageAllocator

    alloc = PageAllocator(capacity_tokens=8192, page_size=page_size)
    table = torch.zeros(8, 1024, dtype=torch.int64)
    base = alloc.alloc(0, 288, None)
    lens = [300, 340, 301, 120]
    for row, n in enumerate(lens[:3]):
        table[row, :n] = torch.tensor(base + alloc.alloc(288, n - 288, None))
    table[3, :120] = torch.tensor(alloc.alloc(0, 120, None))  # shares nothing
    rows, bucket = [3, 0, 1, 2], 8
    found = find_groups(table, rows, [lens[r] for r in rows], page_size=page_size)
    order, grouped, qo_indptr, shared, own = graph_cascade_tables(table, rows, [lens[r] for r in rows], found,
                                                                  page_size, bucket)
    segments = graph_prefix_segments(bucket)
    assert grouped == 3 and order[:3] == [1, 2, 3] and sorted(order) == list(range(bucket))
    assert qo_indptr.tolist() == [0, 3, 8] + [8] * (segments - 2)  # group, the others, empty segments
    assert len(shared.indptr) == segments + 1 and len(own.indptr) == bucket + 1
    assert shared.indices[int(shared.indptr[1]):].tolist() == [0] * (segments - 1)  # the padding page
    for j, i in enumerate(order[:4]):
        pages = own.indices[int(own.indptr[j]):int(own.indptr[j + 1])].tolist()
        if j < grouped:
            pages = shared.indices[:int(shared.indptr[1])].tolist() + pages
        slots = [p * page_size + k for p in pages for k in range(page_size)]
        slots = slots[:len(slots) - page_size + int(own.last_page_len[j])]
        assert slots == table[rows[i], :lens[rows[i]]].tolist()
    assert own.indices[int(own.indptr[4]):].tolist() == [0] * (bucket - 4)  # padding rows
