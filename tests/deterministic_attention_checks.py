"""Checks of the deterministic Triton attention (srt/executor/attention/deterministic_triton.py),
shared by the CPU interpreter test (test_deterministic_triton.py, on small shapes) and the GPU
test (test_gpu_deterministic.py, the Llama-3.1-8B shape): agreement with a float64 reference, and
one query row's bits alone, beside companions, inside extend tiles and from graph tables.
"""

from __future__ import annotations

import random

import torch

from radixlm.srt.executor.attention import deterministic_triton as kernel
from radixlm.srt.executor.attention.deterministic_cuda import TritonDeterministicBackend
from radixlm.srt.executor.attention.layer_spec import LayerAttention
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.mem_pool import KVPool, read_kv

FP8 = torch.float8_e4m3fn
# The last: request 0's query at 149 sees from 130 on, and extend tiles holding it start their
# walk a block earlier (for rows before it), so the guard for unseen blocks is exercised.
SPECS = (LayerAttention(), LayerAttention(40, None), LayerAttention(None, 5.0), LayerAttention(20, 8.0))


class Setup:
    """A pool of random K/V, a token table of `rows` requests (distinct random slots, up to
    `max_len` each) and queries; run() attends through the kernel."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, pool_dtype: torch.dtype,
                 device: str = "cpu", rows: int = 72, max_len: int = 320, seed: int = 0,
                 scales: tuple[float, float] = (1.0, 1.0)):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.scales = scales if pool_dtype == FP8 else (1.0, 1.0)
        num_slots = rows * max_len + 1
        k = torch.randn(kv_heads, num_slots, head_dim, generator=gen) * 2
        v = torch.randn(kv_heads, num_slots, head_dim, generator=gen) * 2
        self.k_buf = k.to(pool_dtype).to(self.device)
        self.v_buf = v.to(pool_dtype).to(self.device)
        self.table = (torch.randperm(num_slots - 1, generator=gen)[:rows * max_len] + 1).view(rows, max_len)
        self.gen = gen

    def queries(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.heads, self.head_dim, generator=self.gen).to(self.dtype).to(self.device)

    def run(self, q: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int],
            spec: LayerAttention = LayerAttention(), table: torch.Tensor | None = None,
            cascade: bool = False) -> torch.Tensor:
        """cascade: a decode step whose requests share segments of `table` runs as a cascade step."""
        table = self.table if table is None else table
        group = self.heads // self.kv_heads
        host = kernel.host_tables(table, rows, seq_lens, extend_lens, group)
        tables = kernel.load_tables(host, self.device)
        if cascade:
            plan = kernel.cascade_plan(table, rows, seq_lens, group)
            tables = kernel.cascade_if_worth_it(tables, plan, seq_lens, self.heads, self.kv_heads, self.head_dim, 0)
            assert tables.cascade_programs, "no shared segments"
        elif all(n == 1 for n in extend_lens):  # as the backend plans a decode step: split where it pays
            tables = kernel.split_if_worth_it(tables, self.heads, self.kv_heads, self.head_dim, max(seq_lens))
        return kernel.attend(q, self.k_buf, self.v_buf, tables, self.head_dim ** -0.5, spec, *self.scales)

    def reference(self, q: torch.Tensor, row: int, seq_len: int, spec: LayerAttention) -> torch.Tensor:
        """float64 attention of q [n, H, D], the request's last n tokens -> [n, H * D]."""
        n = q.shape[0]
        slots = self.table[row, :seq_len].to(self.device)
        keys = read_kv(self.k_buf, slots, torch.float64, self.scales[0]).cpu()
        values = read_kv(self.v_buf, slots, torch.float64, self.scales[1]).cpu()
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        s = torch.einsum("nhd,hkd->nhk", q.cpu().double(), keys) * self.head_dim ** -0.5
        if spec.logit_softcap is not None:
            s = torch.tanh(s / spec.logit_softcap) * spec.logit_softcap
        key_pos = torch.arange(seq_len)[None, :]
        pos = torch.arange(seq_len - n, seq_len)[:, None]
        seen = key_pos <= pos
        if spec.sliding_window is not None:
            seen &= key_pos > pos - spec.sliding_window
        s = s.masked_fill(~seen[:, None], float("-inf"))
        return torch.einsum("nhk,hkd->nhd", s.softmax(-1), values).reshape(n, -1)


def worst_error(setup: Setup, spec: LayerAttention) -> float:
    """Largest |kernel - float64 reference| over a batch of an extend after a cached prefix, a
    decode, a prompt from scratch and a one-token sequence."""
    worst = 0.0
    # (table row, seq len, new tokens): a mixed batch (sequential), then a decode-only one (split)
    for reqs in ([(0, 150, 60), (1, 200, 1), (2, 7, 7), (3, 1, 1)], [(1, 200, 1), (3, 1, 1), (4, 250, 1)]):
        q = setup.queries(sum(n for *_, n in reqs))
        out = setup.run(q, [r for r, *_ in reqs], [s for _, s, _ in reqs], [n for *_, n in reqs], spec)
        start = 0
        for row, seq_len, new in reqs:
            ref = setup.reference(q[start:start + new], row, seq_len, spec)
            error = (out[start:start + new].double().cpu() - ref).abs().max().item()
            worst = max(worst, error if error == error else float("inf"))  # NaN: worst of all
            start += new
    return worst


def variants_of_one_row(setup: Setup, spec: LayerAttention, trials: int, max_companions: int,
                        max_len: int = 300, captured: bool = False) -> dict[str, torch.Tensor]:
    """Request 0's query at position 149 (its row's output) computed: alone; in decode batches
    beside 1..max_companions companions of random lengths; as the last query of extend chunks
    after cached prefixes of several lengths; in the middle of a chunk that goes on past it; in
    a batch with another request's extend; from decode graph tables padded past the batch; and
    with `captured` (GPU), replayed from a CUDA graph."""
    rng = random.Random(0)
    pos = 149
    q_row = setup.queries(1)
    found = {"alone": setup.run(q_row, [0], [pos + 1], [1], spec)[0]}
    for trial in range(trials):
        count = rng.randint(1, max_companions)
        lens = [rng.randint(1, max_len) for _ in range(count)]
        where = rng.randint(0, count)
        rows = list(range(1, count + 1))
        rows.insert(where, 0)
        lens.insert(where, pos + 1)
        q = setup.queries(count + 1)
        q[where] = q_row[0]
        found[f"decode beside {count}"] = setup.run(q, rows, lens, [1] * (count + 1), spec)[where]
    for prefix, past in ((0, 0), (100, 0), (137, 0), (148, 0), (90, 13), (141, 40)):
        new = pos + 1 + past - prefix
        q = setup.queries(new)
        q[pos - prefix] = q_row[0]
        found[f"extend after {prefix} to {pos + past}"] = setup.run(q, [0], [pos + 1 + past], [new], spec)[pos - prefix]
    q = torch.cat([setup.queries(37), q_row])
    found["decode beside an extend"] = setup.run(q, [5, 0], [240, pos + 1], [37, 1], spec)[37]
    found["graph tables"] = graph_row(setup, spec, q_row, split=False)
    found["split graph tables"] = graph_row(setup, spec, q_row, split=True)
    if captured:
        found["replayed graph"] = captured_row(setup, spec, q_row, split=False)
        found["replayed split graph"] = captured_row(setup, spec, q_row, split=True)
    return found


def cascade_variants(setup: Setup, spec: LayerAttention, max_len: int) -> dict[str, torch.Tensor]:
    """Request 0's query at position 2 * SEGMENT + 21 (the setup needs 40 rows) alone, and in
    cascade decode steps where other requests hold the same slots as its first two segments (as
    the radix cache hands a shared prefix out): a group of 2, a group of 24 (two group tiles), a
    group sharing only its first segment, two groups beside requests of their own, and the
    group of 24 beside loners from a cascade graph's fixed tables. The shared segments then
    come from the cascade kernel, the rest from split programs."""
    rng = random.Random(1)
    seg = kernel.SEGMENT
    pos = 2 * seg + 21
    q_row = setup.queries(1)
    table = setup.table.clone()
    table[1:30, :2 * seg] = table[0, :2 * seg]  # rows 1-29 share row 0's first two segments
    table[30:34, :seg + 10] = table[0, :seg + 10]  # rows 30-33 only its first, and 10 keys more
    table[34:38, :seg] = table[38, :seg]  # rows 34-38: another group
    found = {"alone": setup.run(q_row, [0], [pos + 1], [1], spec)[0]}

    def in_batch(name: str, rows: list[int], lens: list[int], where: int):
        q = setup.queries(len(rows))
        q[where] = q_row[0]
        found[name] = setup.run(q, rows, lens, [1] * len(rows), spec, table=table, cascade=True)[where]

    shared_lens = lambda n: [rng.randint(2 * seg + 1, max_len) for _ in range(n)]  # noqa: E731
    in_batch("group of 2", [7, 0], shared_lens(1) + [pos + 1], 1)
    in_batch("group of 24", list(range(1, 13)) + [0] + list(range(13, 24)), shared_lens(12) + [pos + 1] + shared_lens(11),
             12)
    in_batch("sharing one segment", [30, 31, 0, 32], [seg + 40, max_len, pos + 1, pos], 2)
    in_batch("two groups and loners", [34, 2, 39, 35, 0, 38, 3, 36], [rng.randint(seg + 1, max_len) for _ in range(4)]
             + [pos + 1] + [rng.randint(seg + 1, max_len) for _ in range(3)], 4)
    rows = list(range(1, 13)) + [0] + list(range(13, 24)) + [34, 35, 36, 38]
    lens = shared_lens(12) + [pos + 1] + shared_lens(11) + [rng.randint(seg + 1, max_len) for _ in range(4)]
    q = setup.queries(len(rows))
    q[12] = q_row[0]
    found["cascade graph tables"] = cascade_graph_rows(setup, spec, table, rows, lens, q, bs=32)[12]
    return found


def cascade_graph_rows(setup: Setup, spec: LayerAttention, table: torch.Tensor, rows: list[int], lens: list[int],
                       q: torch.Tensor, bs: int) -> torch.Tensor:
    """A decode step through the backend's cascade graph tables for bucket bs (padded past the
    batch), planned as cuda_graph_runner does: capture with nothing shared, then replay."""
    pool = KVPool(1, 1, setup.kv_heads, setup.head_dim, setup.k_buf.dtype, "cpu")
    pool.k_buffers, pool.v_buffers = [setup.k_buf], [setup.v_buf]
    pool.k_scale, pool.v_scale = setup.scales
    backend = TritonDeterministicBackend(pool, table, setup.head_dim ** -0.5, setup.heads, [spec])
    backend._min_saved_keys = 0  # whatever this small setup saves
    backend.init_cuda_graph_state(bs, 1)
    loc = torch.zeros(bs, dtype=torch.int64, device=setup.device)
    batch = decode_batch(rows, lens)
    variant = backend.choose_cuda_graph_variant(batch, bs)
    assert variant == "cascade", variant
    handle = backend.capture_cuda_graph_plan(variant, bs, loc)
    backend.replay_cuda_graph_plan(variant, handle, batch, bs, loc)
    q = torch.cat([q, setup.queries(bs - len(rows))])
    return kernel.attend(q, setup.k_buf, setup.v_buf, backend._tables, setup.head_dim ** -0.5, spec, *setup.scales)


def graph_row(setup: Setup, spec: LayerAttention, q_row: torch.Tensor, split: bool) -> torch.Tensor:
    """The row through the backend's CUDA-graph tables (a bucket of 8 holding 3 requests, the
    rest padding), planned as cuda_graph_runner does: capture once, then replay; the sequential
    variant, or the split one the backend chooses for the batch."""
    pool = KVPool(1, 1, setup.kv_heads, setup.head_dim, setup.k_buf.dtype, "cpu")
    pool.k_buffers, pool.v_buffers = [setup.k_buf], [setup.v_buf]
    pool.k_scale, pool.v_scale = setup.scales
    backend = TritonDeterministicBackend(pool, setup.table, setup.head_dim ** -0.5, setup.heads, [spec])
    backend.init_cuda_graph_state(16, 1)
    loc = torch.zeros(8, dtype=torch.int64, device=setup.device)
    batch = decode_batch([3, 0, 7], [90, 150, 260])
    variant = backend.choose_cuda_graph_variant(batch, 8) if split else "decode"
    assert variant.startswith("split") == split, variant
    handle = backend.capture_cuda_graph_plan(variant, 8, loc)
    backend.replay_cuda_graph_plan(variant, handle, batch, 8, loc)
    q = torch.cat([setup.queries(1), q_row, setup.queries(6)])
    out = kernel.attend(q, setup.k_buf, setup.v_buf, backend._tables, setup.head_dim ** -0.5, spec, *setup.scales)
    return out[1]


def decode_batch(rows: list[int], seq_lens: list[int]) -> ForwardBatch:
    n = len(rows)
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(n, dtype=torch.int64),
                        positions=torch.tensor([s - 1 for s in seq_lens]), out_cache_loc=torch.zeros(n, dtype=torch.int64),
                        req_pool_indices=torch.tensor(rows), req_pool_indices_cpu=rows, seq_lens=torch.tensor(seq_lens),
                        seq_lens_cpu=seq_lens, prefix_lens_cpu=[s - 1 for s in seq_lens], extend_lens_cpu=[1] * n,
                        logit_rows=torch.arange(n))


def differing(found: dict[str, torch.Tensor]) -> list[str]:
    """The variants whose bits differ from computing the row alone."""
    alone = found["alone"]
    return [name for name, row in found.items() if not torch.equal(row, alone)]


def captured_row(setup: Setup, spec: LayerAttention, q_row: torch.Tensor, split: bool) -> torch.Tensor:
    """The row from a real CUDA graph (GPU only): the kernel captured over the backend's graph
    tables for a bucket of 8 padding rows, then replayed for 3 requests, the row second; the
    sequential variant or the split one the backend chooses for them."""
    pool = KVPool(1, 1, setup.kv_heads, setup.head_dim, setup.k_buf.dtype, setup.device)
    pool.k_buffers, pool.v_buffers = [setup.k_buf], [setup.v_buf]
    pool.k_scale, pool.v_scale = setup.scales
    backend = TritonDeterministicBackend(pool, setup.table, setup.head_dim ** -0.5, setup.heads, [spec])
    backend.init_cuda_graph_state(16, 1)
    loc = torch.zeros(8, dtype=torch.int64, device=setup.device)
    q = torch.zeros(8, setup.heads, setup.head_dim, dtype=setup.dtype, device=setup.device)
    out = q.new_empty(8, setup.heads * setup.head_dim)
    batch = decode_batch([3, 0, 7], [90, 150, 260])
    variant = backend.choose_cuda_graph_variant(batch, 8) if split else "decode"
    handle = backend.capture_cuda_graph_plan(variant, 8, loc)

    def run():
        kernel.attend(q, setup.k_buf, setup.v_buf, backend._tables, setup.head_dim ** -0.5, spec, *setup.scales, out=out)

    run()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    backend.replay_cuda_graph_plan(variant, handle, batch, 8, loc)
    q[:3] = torch.cat([setup.queries(1), q_row, setup.queries(1)])
    graph.replay()
    torch.cuda.synchronize()
    return out[1].clone()
