"""The attention of --enable-deterministic-inference on CUDA: deterministic_triton.py's kernel for
every step, decode and extend alike, and decode steps captured in CUDA graphs.

The torch backend (deterministic.py) runs its block products through cuBLAS, which picks its
kernel (split-K included) from the batch, and its reductions through kernels whose launch
follows the number of outputs; on a GPU that made a query's bits depend on its companions. The
kernel here has one configuration for every call, so a query's result depends only on its own
tokens and keys. A graph replays the same launches over fixed tables (per row: where its query
and its keys' slots are), so a step replayed and one run eagerly give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..mem_pool import KVPool
from . import deterministic_triton as kernel
from .base import DEFAULT_GRAPH_VARIANT, AttentionBackend
from .layer_spec import LOGIT_SOFTCAP, SLIDING_WINDOW, LayerAttention

PADDING_SLOT = 0  # cuda_graph_runner.PADDING_SLOT: padding rows' one key
# Cascade decode (deterministic_triton.cascade_if_worth_it) saves re-reading the segments a group
# of requests shares, for two more launches a layer: taken from this many bytes of K/V reads
# saved per layer, replayed from a bucket's cascade graph or eagerly.
CASCADE_MIN_SAVED_BYTES = 32 << 20
CASCADE_GRAPH_VARIANT = "cascade"
# The decode graphs' table of key slots (int32), at most this large unless twice the pool is larger.
GRAPH_SLOT_TABLE_BYTES = 64 << 20


class TritonDeterministicBackend(AttentionBackend):
    SUPPORTED_FEATURES = frozenset({SLIDING_WINDOW, LOGIT_SOFTCAP})

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float, num_heads: int,
                 layers: Sequence[LayerAttention] | None = None, cascade: bool = True):
        """req_to_token: the host table (ReqToTokenTable.table, viewed as a tensor); cascade: False
        keeps every decode step plain (--disable-cascade-attention)."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.layers = list(layers) if layers is not None else [LayerAttention()] * len(kv_pool.k_buffers)
        self.device = kv_pool.k_buffers[0].device
        self.num_heads = num_heads
        self.num_kv_heads, _, self.head_dim = kv_pool.k_buffers[0].shape
        self.group = num_heads // self.num_kv_heads
        self._tables: kernel.Tables | None = None
        self._out_cache_loc: torch.Tensor | None = None
        self._graph: _GraphTables | None = None
        self._bounds: dict[int, list[int]] = {}  # _split_bounds per graph bucket size
        # Windows read segments a cascade group tile would not; those models decode plainly.
        self.cascade = cascade and all(layer.sliding_window is None for layer in self.layers)
        self._plan_of: tuple[ForwardBatch, object] | None = None
        pool_bytes = kv_pool.k_buffers[0].element_size() * self.num_kv_heads * self.head_dim * 2
        self._min_saved_keys = -(-CASCADE_MIN_SAVED_BYTES // pool_bytes)

    def plan(self, batch: ForwardBatch) -> None:
        rows, seq_lens = batch.req_pool_indices_cpu, batch.seq_lens_cpu
        host = kernel.host_tables(self.req_to_token, rows, seq_lens, batch.extend_lens_cpu, self.group)
        tables = kernel.load_tables(host, self.device)
        if all(n == 1 for n in batch.extend_lens_cpu):
            tables = kernel.cascade_if_worth_it(tables, self._cascade_plan(batch), seq_lens, self.num_heads,
                                                self.num_kv_heads, self.head_dim, self._min_saved_keys)
            if not tables.cascade_programs:
                tables = kernel.split_if_worth_it(tables, self.num_heads, self.num_kv_heads, self.head_dim,
                                                  max(seq_lens))
        self._tables = tables
        self._out_cache_loc = batch.out_cache_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        pool = self.kv_pool
        pool.store(layer_id, self._out_cache_loc, k, v)
        return kernel.attend(q, pool.k_buffers[layer_id], pool.v_buffers[layer_id], self._tables,
                             self.scale, self.layers[layer_id], pool.k_scale, pool.v_scale)

    # ---- CUDA graphs: decode rows in fixed tables ------------------------------------------

    @property
    def supports_cuda_graph(self) -> bool:
        return True

    def graph_can_replay(self, batch: ForwardBatch) -> bool:
        """A batch whose keys do not fit the graph's slot table runs eagerly (the same kernels)."""
        return sum(batch.seq_lens_cpu) <= self._graph.slots.numel()

    def _cascade_plan(self, batch: ForwardBatch):
        """kernel.cascade_plan for a decode batch, found once per batch (choose_cuda_graph_variant or plan)."""
        if not (self.cascade and batch.is_decode):
            return None
        if self._plan_of is None or self._plan_of[0] is not batch:
            self._plan_of = (batch, kernel.cascade_plan(self.req_to_token, batch.req_pool_indices_cpu,
                                                        batch.seq_lens_cpu, self.group))
        return self._plan_of[1]

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        # Room for every request at full context, up to GRAPH_SLOT_TABLE_BYTES (or twice the
        # pool, when more): requests sharing a cached prefix list its slots once each, so a step
        # can hold many times the pool's keys. graph_can_replay runs a larger step eagerly.
        capacity = min(max_bs * self.req_to_token.shape[1],
                       max(2 * self.kv_pool.k_buffers[0].shape[1], GRAPH_SLOT_TABLE_BYTES // 4))
        context_segments = -(-self.req_to_token.shape[1] // kernel.SEGMENT)
        members = kernel.tokens_per_tile(self.group)
        self._graph = _GraphTables(max_bs, capacity, members, max_bs * context_segments, self.device)
        # One workspace for every split and cascade graph (one replays at a time), as large as
        # any may need.
        rows = max([bs * segments for bs in range(1, max_bs + 1) for segments in self._split_bounds(bs)]
                   + [bs * self._cascade_segments(bs) for bs in range(1, max_bs + 1)])
        self._graph_partials = kernel.split_partials(rows, self.num_heads, self.head_dim, 1, self.device)

    def _split_bounds(self, bs: int) -> list[int]:
        """Segment counts a split decode graph of bs rows is captured for: powers of 4 up to the
        context length, where split_segments would split a batch that long (kept per bs: every
        replayed step asks)."""
        bounds = self._bounds.get(bs)
        if bounds is None:
            context = self.req_to_token.shape[1]
            bounds, bound = [], 4
            while (bound // 4) * kernel.SEGMENT < context:
                if kernel.split_segments(bs, self.num_heads, self.num_kv_heads, self.head_dim,
                                         bound * kernel.SEGMENT):
                    bounds.append(bound)
                bound *= 4
            self._bounds[bs] = bounds
        return bounds

    def _cascade_segments(self, bs: int) -> int:
        """Segments per row a cascade graph of bs rows keeps partial results for: the context's,
        or as many as fit CASCADE_WORKSPACE_BYTES; 0: no cascade graph at bs."""
        if not self.cascade or bs < 2 or kernel.tokens_per_tile(self.group) < 2 or self.group > kernel.BLOCK_M:
            return 0
        per_segment = 4 * kernel.split_partials_floats(bs, self.num_heads, self.head_dim, 1)
        segments = min(-(-self.req_to_token.shape[1] // kernel.SEGMENT), kernel.CASCADE_WORKSPACE_BYTES // per_segment)
        return segments if segments >= 2 else 0

    def cuda_graph_variants(self, bs: int) -> tuple[str, ...]:
        """DEFAULT_GRAPH_VARIANT runs sequentially (any length); "splitN" splits into N segments;
        CASCADE_GRAPH_VARIANT is a cascade step (split, with group tiles)."""
        cascade = (CASCADE_GRAPH_VARIANT,) if self._cascade_segments(bs) else ()
        return (DEFAULT_GRAPH_VARIANT,) + tuple(f"split{n}" for n in self._split_bounds(bs)) + cascade

    def choose_cuda_graph_variant(self, batch: ForwardBatch, bs: int) -> str:
        needed = -(-max(batch.seq_lens_cpu) // kernel.SEGMENT)
        plan = self._cascade_plan(batch)
        if (plan is not None and plan[3] >= self._min_saved_keys and needed <= self._cascade_segments(bs)
                and sum(plan[1]) <= self._graph.item_capacity):
            return CASCADE_GRAPH_VARIANT
        fits = [n for n in self._split_bounds(bs) if n >= needed] if needed >= 2 else []
        return f"split{fits[0]}" if fits else DEFAULT_GRAPH_VARIANT

    def capture_cuda_graph_plan(self, variant: str, bs: int, out_cache_loc: torch.Tensor) -> object:
        self.replay_cuda_graph_plan(variant, bs, None, bs, out_cache_loc)
        return bs

    def replay_cuda_graph_plan(self, variant: str, handle: object, batch: ForwardBatch | None, bs: int,
                               out_cache_loc: torch.Tensor) -> None:
        rows, seq_lens = (batch.req_pool_indices_cpu, batch.seq_lens_cpu) if batch is not None else ([], [])
        tables = self._graph.plan(self.req_to_token, rows, seq_lens, bs)
        part_acc, part_ml = self._graph_partials
        if variant == CASCADE_GRAPH_VARIANT:
            plan = self._cascade_plan(batch) if batch is not None else None
            # Fixed grids: every KV head's CASCADE_PROGRAMS cascade programs, and split programs
            # enough to fill the GPU, each taking every split_programs-th of its own segments.
            programs = max(1, -(-kernel.SPLIT_BELOW_PROGRAMS // (bs * self.num_kv_heads)))
            tables = self._graph.cascade(tables, plan, bs)._replace(
                segments=self._cascade_segments(bs), part_acc=part_acc, part_ml=part_ml, split_programs=programs,
                cascade_programs=kernel.CASCADE_PROGRAMS)
        elif variant != DEFAULT_GRAPH_VARIANT:
            tables = tables._replace(segments=int(variant.removeprefix("split")), part_acc=part_acc, part_ml=part_ml)
        self._tables = tables
        self._out_cache_loc = out_cache_loc


class _GraphTables:
    """Fixed-address tables for decode graphs of up to max_bs rows: tile i is row i's one token
    (q row i), so only the keys' offsets and slots change between replays; every bucket shares
    them (one graph runs at a time). Padding rows see one key, at PADDING_SLOT."""

    def __init__(self, max_bs: int, capacity: int, members: int, item_capacity: int, device: torch.device):
        """capacity: key slots; members: requests per cascade group tile; item_capacity:
        (group tile, shared segment) pairs a cascade step may list."""
        arange = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.q_indptr = arange
        self.tile_req = arange[:max_bs]
        self.tile_tok = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.kv_indptr = arange.clone()
        self.slots = torch.zeros(capacity, dtype=torch.int32, device=device)
        # A cascade step's tables: a group tile has at least one member, so max_bs of them fit.
        self.tile_skip = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.group_members = torch.full((max_bs * members,), -1, dtype=torch.int32, device=device)
        self.item_capacity = item_capacity
        self.items = torch.zeros(2 * item_capacity, dtype=torch.int32, device=device)
        self.item_count = torch.zeros(1, dtype=torch.int32, device=device)

    def plan(self, req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], bs: int) -> kernel.Tables:
        num_pad = bs - len(rows)
        table = req_to_token.numpy()
        offsets = np.zeros(bs + 1, dtype=np.int64)
        np.cumsum(np.asarray(list(seq_lens) + [1] * num_pad, dtype=np.int64), out=offsets[1:])
        # Straight into the pinned buffer and on to the fixed tables: this runs every decode step.
        ring = kernel.staging_ring(self.slots.device)
        host = ring.stage([offsets] + [table[row, :n] for row, n in zip(rows, seq_lens)]
                          + [np.full(num_pad, PADDING_SLOT, dtype=np.int64)])
        self.kv_indptr[:bs + 1].copy_(host[:bs + 1], non_blocking=True)
        self.slots[:host.numel() - bs - 1].copy_(host[bs + 1:], non_blocking=True)
        ring.sent()
        return kernel.Tables(self.q_indptr, self.kv_indptr, self.slots, self.tile_req, self.tile_tok, bs)

    def cascade(self, tables: kernel.Tables, plan, bs: int) -> kernel.Tables:
        """`tables` (plan's, for the same batch) as a cascade step of cascade_plan's `plan`
        (None: a step with no shared segment, as captured): padding rows and loners skip
        nothing."""
        members, shared, skip, _ = plan if plan is not None else ([], [], [], 0)
        items = kernel.cascade_items(shared)
        count, skips, members, items = kernel.upload(
            [np.asarray(xs, dtype=np.int64) for xs in ([len(items) // 2], list(skip) + [0] * (bs - len(skip)),
                                                       members, items)], self.slots.device)
        self.item_count.copy_(count)
        self.tile_skip[:bs].copy_(skips)
        self.group_members[:len(members)].copy_(members)
        self.items[:len(items)].copy_(items)
        return tables._replace(tile_skip=self.tile_skip, group_members=self.group_members, cascade_items=self.items,
                               cascade_count=self.item_count)
