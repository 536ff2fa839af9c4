"""CUDA graphs of the FlashInfer backend: its AttentionBackend graph hooks (base.py gives their
order and invariants) and the fixed-address state they plan into.

Every bucket captures a plain decode graph: over triton_decode.py's kernel (its page tables in
fixed buffers) or, for models with windows or soft-caps, over FlashInfer decode wrappers made
with CUDA-graph buffers. Buckets of CASCADE_GRAPH_MIN_BS requests and up add a cascade graph
(flashinfer_backend.py's docstring), replayed when a batch's shared prefixes save enough reads.
"""

from __future__ import annotations

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from .base import DEFAULT_GRAPH_VARIANT
from .flashinfer_cascade import (GraphCascade, CascadeStep, graph_cascade_tables,
                                 graph_prefix_segments)
from .paged_kv import PagedKV, build_paged_kv
from .triton_decode import load_decode_tables

# Decode buckets this large get a second CUDA graph, with cascade attention (smaller batches
# rarely share enough to matter, and each graph adds ~1.5 s of start-up capture).
CASCADE_GRAPH_MIN_BS = 64
TRITON_GRAPH_HANDLE = "triton_decode"  # a plain decode graph of triton_decode.py: its tables, not wrappers
CASCADE_GRAPH_VARIANT = "cascade"  # that graph's name in the AttentionBackend graph hooks
# A cascade graph costs four small kernels per layer more than the plain one (~15 us).
CASCADE_IN_GRAPH_MIN_SAVED_BYTES = 64 << 20


class FlashInferGraphs:
    """The graph half of FlashInferBackend (a mixin: it uses the backend's plan state, wrappers
    and `_reset_step`)."""

    @property
    def supports_cuda_graph(self) -> bool:
        return True

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        # One page-index buffer per level for all buckets: only one graph runs at a time.
        self._graph_page_indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=self.device)
        self._graph_prefix_page_indices = (torch.zeros_like(self._graph_page_indices)
                                           if self.cascade and max_bs >= CASCADE_GRAPH_MIN_BS else None)
        # Each window's wrappers copy their page indices into their own buffer at plan time.
        self._graph_window_page_indices = {window: torch.zeros_like(self._graph_page_indices)
                                           for window in self._windows if window != -1}
        if self._triton_decode:
            self._decode_graph_meta = torch.zeros(2 * max_bs + 1, dtype=torch.int32, device=self.device)

    def cuda_graph_variants(self, bs: int) -> tuple[str, ...]:
        """Plain decode; buckets of CASCADE_GRAPH_MIN_BS and up add a cascade graph."""
        if self.cascade and bs >= CASCADE_GRAPH_MIN_BS:
            return (DEFAULT_GRAPH_VARIANT, CASCADE_GRAPH_VARIANT)
        return (DEFAULT_GRAPH_VARIANT,)

    def capture_cuda_graph_plan(self, variant: str, bs: int, out_cache_loc: torch.Tensor) -> object:
        if variant == CASCADE_GRAPH_VARIANT:
            handle = self._make_graph_cascade(bs, self._graph_page_indices, self._graph_prefix_page_indices)
            self._plan_graph_cascade(handle, None, bs, out_cache_loc)
            return handle
        if self._triton_decode:
            self._plan_graph_triton(None, bs, out_cache_loc)
            return TRITON_GRAPH_HANDLE
        wrappers = {window: self._make_graph_decode_wrapper(bs, self._graph_window_page_indices.get(
            window, self._graph_page_indices)) for window in self._windows}
        self._plan_graph_decode(wrappers, None, bs, out_cache_loc)
        return wrappers

    def choose_cuda_graph_variant(self, batch: ForwardBatch, bs: int) -> str:
        return CASCADE_GRAPH_VARIANT if self._wants_graph_cascade(batch, bs) else DEFAULT_GRAPH_VARIANT

    def replay_cuda_graph_plan(self, variant: str, handle: object, batch: ForwardBatch, bs: int,
                               out_cache_loc: torch.Tensor) -> None:
        if variant == CASCADE_GRAPH_VARIANT:
            self._plan_graph_cascade(handle, batch, bs, out_cache_loc)
        elif handle is TRITON_GRAPH_HANDLE:
            self._plan_graph_triton(batch, bs, out_cache_loc)
        else:
            self._plan_graph_decode(handle, batch, bs, out_cache_loc)

    def _wants_graph_cascade(self, batch: ForwardBatch, padded_size: int) -> bool:
        groups = self._decode_groups(batch)
        return (groups is not None and self._saved_bytes(groups) >= CASCADE_IN_GRAPH_MIN_SAVED_BYTES
                and len(groups.groups) < graph_prefix_segments(padded_size))

    def _make_graph_decode_wrapper(self, batch_size: int, indices_buffer: torch.Tensor):
        """A decode wrapper whose page-table buffers have fixed addresses, for one captured batch
        size. All buckets can share `indices_buffer`: only one graph runs at a time."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            backend=self.kernels)

    def _make_graph_cascade(self, batch_size: int, own_indices: torch.Tensor,
                            prefix_indices: torch.Tensor) -> GraphCascade:
        """Level-2 (decode) and level-1 (prefill, non-causal) wrappers with fixed buffers for a
        cascade decode graph of `batch_size` rows."""
        def zeros(n: int, dtype=torch.int32) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        segments = graph_prefix_segments(batch_size)
        if self._cascade_workspace is None:  # sized by the first (largest) bucket captured
            self._cascade_workspace = torch.zeros(self._graph_prefix_scratch_bytes(batch_size, segments),
                                                  dtype=torch.uint8, device=self.device)
        prefix = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._cascade_workspace, "HND", use_cuda_graph=True, qo_indptr_buf=zeros(segments + 1),
            paged_kv_indptr_buf=zeros(segments + 1), paged_kv_indices_buf=prefix_indices,
            paged_kv_last_page_len_buf=zeros(segments), backend=self.kernels)
        rows = torch.arange(batch_size, device=self.device)
        return GraphCascade(self._make_graph_decode_wrapper(batch_size, own_indices), prefix, rows, rows.clone(),
                            zeros(batch_size, torch.bool))

    def _graph_prefix_scratch_bytes(self, batch_size: int, segments: int) -> int:
        """Split-KV scratch of a graph-mode level-1 plan: FlashInfer sizes it for its largest
        grid, one 128-row query tile (outputs and log-sum-exp, float32) per CTA: a tile per
        segment plus the packed rows' tiles, and headroom for its minimum split grid."""
        group = self.num_heads // self.num_kv_heads
        ctas = segments + -(-batch_size * group // 128) + 64
        return ctas * 128 * self.num_heads * (self.head_dim + 1) * 4 + (32 << 20)

    def _plan_graph_cascade(self, graph: GraphCascade, batch: ForwardBatch | None, padded_size: int,
                            out_cache_loc: torch.Tensor) -> None:
        """Plans a cascade graph bucket for `batch` (all padding when None)."""
        self._planning()
        rows, seq_lens = (batch.req_pool_indices_cpu, batch.seq_lens_cpu) if batch is not None else ([], [])
        found = self._decode_groups(batch) if batch is not None else None
        self._reset_step(out_cache_loc)
        order, num_grouped, qo_indptr, shared, own = graph_cascade_tables(self.req_to_token, rows, seq_lens, found,
                                                                          self.page_size, padded_size)
        graph.prefix.plan(qo_indptr, shared.indptr, shared.indices.to(self.device, non_blocking=True),
                          shared.last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                          causal=False, sm_scale=self.scale, logits_soft_cap=self.softcap, q_data_type=self.dtype,
                          kv_data_type=self.kv_dtype)
        self._plan_decode(graph.decode, PagedKV(own.indptr, own.indices.to(self.device, non_blocking=True),
                                                own.last_page_len))
        perm = np.asarray(order, dtype=np.int64)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(len(perm))
        mask = (np.arange(len(perm)) < num_grouped).astype(np.int64)
        host = torch.from_numpy(np.stack([perm, inv, mask]))
        both = host.to(self.device, non_blocking=True)
        graph.order.copy_(both[0])
        graph.inverse.copy_(both[1])
        graph.merge_mask.copy_(both[2].bool())
        self._cascade = CascadeStep(num_grouped, graph.order, graph.inverse, graph.decode, graph.prefix,
                                     graph.merge_mask)
        self._planned()

    def _plan_graph_decode(self, wrappers: dict[int, object], batch: ForwardBatch | None, padded_size: int,
                           out_cache_loc: torch.Tensor) -> None:
        """Plans the bucket's `wrappers` (one per window_left) for `batch` padded to `padded_size`
        (all padding when batch is None); the layers then store K/V at the fixed `out_cache_loc`."""
        self._planning()
        self._reset_step(out_cache_loc)
        rows, seq_lens = (batch.req_pool_indices_cpu, batch.seq_lens_cpu) if batch is not None else ([], [])
        kv = build_paged_kv(self.req_to_token, rows, seq_lens, self.page_size, padded_size)
        # Host indices would make the graph wrapper copy them blocking, waiting for every step
        # still running; copied here first, its copy into the graph's buffer is device to device.
        kv = PagedKV(kv.indptr, kv.indices.to(self.device, non_blocking=True), kv.last_page_len)
        for window, wrapper in wrappers.items():
            self._plan_decode(wrapper, kv, window)
        self._planned()

    def _plan_graph_triton(self, batch: ForwardBatch | None, padded_size: int, out_cache_loc: torch.Tensor) -> None:
        """The Triton decode graph of `padded_size` rows: the tables go into the fixed buffers the
        captured kernels read (indptr | last_page_len and the shared page indices)."""
        self._planning()
        self._reset_step(out_cache_loc)
        rows, seq_lens = (batch.req_pool_indices_cpu, batch.seq_lens_cpu) if batch is not None else ([], [])
        kv = build_paged_kv(self.req_to_token, rows, seq_lens, self.page_size, padded_size)
        self._decode_tables = load_decode_tables(kv, self.device, self.num_kv_heads, self._sm_count,
                                                 self._decode_graph_meta, self._graph_page_indices)
        self._planned()
