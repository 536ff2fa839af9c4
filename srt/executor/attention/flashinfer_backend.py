"""FlashInfer paged attention (CUDA): one plan per batch, reused by every layer.

The KV pool stays head-major ([Hkv, slots, D] per layer). Viewed as pages that is
[Hkv, num_pages, page_size, D]; permuted to [num_pages, Hkv, page_size, D] it is FlashInfer's
HND layout with a head stride of `slots * D`, which its kernels accept (they read strides).
Extend batches use the paged prefill kernel with a causal mask aligned to each request's end,
so cached prefixes and new tokens are one KV sequence. Over an FP8 pool (no windows) they
instead attend the new tokens' bf16 K/V as computed (ragged prefill, causal) and the cached
prefixes' FP8 pages (paged prefill, only when a request has one), merged by log-sum-exp:
FlashInfer's prefill reading FP8 pages was ~6% slower end to end on the offline workload.
Plain decode steps run our Triton kernel (triton_decode.py), and cascade steps and layers with
windows or soft-caps FlashInfer's tensor-core decode kernel (GQA groups share K/V loads). FlashInfer's FA2 kernels throughout:
they compile in ~30 s on a fresh machine, FA3 in ~100 s.

Cascade decode: requests holding the same KV slots for a long prefix (cascade_groups.py) are
reordered so each group's queries are contiguous; level 1 attends each group's queries together
to its shared prefix pages (the prefill kernel, non-causal, one qo segment per group), level 2
every request to its own remaining pages (the decode kernel; ungrouped requests: all of their
pages), and the two partial results merge through their log-sum-exp (merge_state_in_place).
The shared prefix is then read once per group per layer instead of once per request. Buckets
of CASCADE_GRAPH_MIN_BS requests and up capture a cascade CUDA graph beside the plain one (the
"cascade" graph variant); at smaller buckets a cascade step runs eagerly, so a batch that the
plain graph could run takes it only when it saves enough KV reads to pay for eager launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..mem_pool import KVPool
from .base import AttentionBackend
from .cascade_groups import CASCADE_MIN_PREFIX, CascadeGroups, find_groups
from .flashinfer_cascade import CascadeStep, cascade_page_tables
from .flashinfer_graphs import FlashInferGraphs
from .layer_spec import LOGIT_SOFTCAP, SLIDING_WINDOW, LayerAttention
from .paged_kv import PagedKV, as_pages, build_paged_kv, qo_indptr_for
from .triton_decode import DecodeTables, load_decode_tables

WORKSPACE_BYTES = 256 * 1024 * 1024  # split-KV partial results; FlashInfer recommends >= 128 MiB
_BACKEND = "fa2"

# Shared-prefix KV bytes per layer that cascade must save before a decode step gives up its
# CUDA graph. An eager step costs ~330 us of host launch time per layer (Llama-3.1-8B shape on
# the H200: 11.3 ms per token eager vs 5.4 ms with graphs at batch 1, 32 layers); launches run
# ahead of the GPU, so eager costs nothing once the step's GPU time exceeds that. Saving 1 GiB
# per layer (~250 us at ~4.2 TB/s), on top of the weight and suffix reads the step still does,
# makes the plain step GPU-bound beyond the eager host time, so the cascade step is faster.
# For the 8B shape (4 KiB of K+V per token per layer) that is ~262k shared tokens not re-read:
# e.g. 9 groups x 16 requests on a 2048-token prefix; smaller batches keep their graph.
CASCADE_GRAPH_MIN_SAVED_BYTES = 1 << 30
# For a step that runs eagerly anyway (no graph for its batch size, or graphs off), cascade
# adds four small kernels per layer (query gather, prefix attention, merge, output scatter):
# a few microseconds, which 32 MiB of reads (~8 us) more than repays.
CASCADE_EAGER_MIN_SAVED_BYTES = 32 << 20


class FlashInferBackend(FlashInferGraphs, AttentionBackend):
    """Sliding windows and soft-capping: FlashInfer takes both at plan time (`window_left`,
    `logits_soft_cap`), so each distinct window has its own prefill and decode wrapper (and its
    own page-index buffer in CUDA graphs), planned once per batch with the same page tables;
    each layer runs its window's wrapper. Models with windows run without cascade decode (a
    window rarely reaches back into a long shared prefix)."""

    SUPPORTED_FEATURES = frozenset({SLIDING_WINDOW, LOGIT_SOFTCAP})

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, page_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype, cascade: bool = True,
                 layers: Sequence[LayerAttention] | None = None, fused_rotary_store: bool = True):
        """cascade: False keeps every decode step plain (--disable-cascade-attention).
        layers: each layer's window and soft-cap (plain causal attention everywhere when None).
        fused_rotary_store: the rotation and the KV store in one launch where they apply."""
        import flashinfer

        self._flashinfer = flashinfer
        self.kernels = _BACKEND  # FlashInfer's kernel family for every wrapper, graph ones too
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.fused_rotary_store = fused_rotary_store
        self.page_size = page_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.dtype = dtype
        # The pool's dtype: the model's, or float8_e4m3fn, which the kernels read directly with
        # the pool's K/V scales (k_scale folds into sm_scale; v_scale scales the output).
        self.kv_dtype = kv_pool.k_buffers[0].dtype
        scaled = kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn and (kv_pool.k_scale, kv_pool.v_scale) != (1.0, 1.0)
        self._kv_scales = {"k_scale": kv_pool.k_scale, "v_scale": kv_pool.v_scale} if scaled else {}
        self.device = kv_pool.k_buffers[0].device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=_BACKEND)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=True,
                                                                    backend=_BACKEND)
        self._ragged_step = False  # this extend attends its new tokens by ragged prefill (module docstring)
        self._ragged_prefix = False  # this extend also attends cached prefixes (paged, then merged)
        layers = list(layers) if layers is not None else [LayerAttention()] * len(kv_pool.k_buffers)
        caps = {spec.logit_softcap for spec in layers}
        if len(caps) > 1:
            raise ValueError(f"{type(self).__name__}: layers with different logit soft-caps are not supported")
        self.softcap = caps.pop()
        self._layer_window = [spec.window_left for spec in layers]  # FlashInfer's window_left, -1: none
        self._windows = sorted(set(self._layer_window))
        # Wrappers of the windowed layers; the full-attention ones are self.prefill / self.decode.
        # Every wrapper shares the workspace: they run one after another on one stream.
        self._window_wrappers = {
            window: (flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=_BACKEND),
                     flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=True,
                                                                   backend=_BACKEND))
            for window in self._windows if window != -1}
        cascade = cascade and self._windows == [-1]
        if self.kv_dtype == torch.float8_e4m3fn and self._windows == [-1]:
            self._ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD",
                                                                                   backend=_BACKEND)
        else:
            self._ragged_wrapper = None
        self.kv_pages = [(as_pages(k, page_size), as_pages(v, page_size))
                         for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers)]
        self._wrappers: dict[int, object] = {}  # this batch's planned wrapper per window_left
        self._out_cache_loc: torch.Tensor | None = None
        self._plan_copied: torch.cuda.Event | None = None  # see _planning
        self._cascade_workspace: torch.Tensor | None = None  # level-1 scratch of the cascade graphs
        # Page indices of every graph bucket (level 2, level 1): init_cuda_graph_state.
        self._graph_page_indices: torch.Tensor | None = None
        self._graph_prefix_page_indices: torch.Tensor | None = None
        self._graph_window_page_indices: dict[int, torch.Tensor] = {}
        self.cascade = cascade
        self._kv_bytes_per_token = 2 * num_kv_heads * head_dim * self.kv_dtype.itemsize  # K and V, one layer
        # Plain decode steps run triton_decode.py's kernel: faster than FlashInfer's decode at
        # every batch and length measured, and it reads FP8 pools faster than bf16 ones (its
        # docstring). Windows, soft-caps and cascade steps stay on FlashInfer.
        self._triton_decode = (self.device.type == "cuda" and self._windows == [-1] and not self.softcap
                               and head_dim >= 16 and head_dim & (head_dim - 1) == 0)
        self._sm_count = (torch.cuda.get_device_properties(self.device).multi_processor_count
                          if self._triton_decode else 0)
        self._decode_tables: DecodeTables | None = None  # this decode step's page tables on the device
        self._decode_graph_meta: torch.Tensor | None = None  # graph buckets' indptr | last_page_len
        self._cascade: CascadeStep | None = None  # this batch's cascade plan, None for a plain step
        self._groups_of: tuple[ForwardBatch, CascadeGroups | None] | None = None  # from prefers_eager
        if cascade:
            # merge_state's kernels compile just in time (once per machine): at startup, rather
            # than stalling the first decode step that has groups.
            from flashinfer.cascade import get_cascade_module

            get_cascade_module()

    # ---- planning ----------------------------------------------------------------------------

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        """A decode batch whose shared prefixes save enough KV reads to run cascade attention
        eagerly rather than replay the plain decode CUDA graph (for a bucket without a cascade
        graph)."""
        groups = self._decode_groups(batch)
        return groups is not None and self._saved_bytes(groups) >= CASCADE_GRAPH_MIN_SAVED_BYTES

    def _planning(self) -> None:
        """Waits until the device has taken the previous plan. A wrapper's plan writes a pinned
        host buffer and queues its copy to the device; with overlap scheduling the next plan can
        come before the device reaches that copy, and would overwrite what it has not read."""
        if self._plan_copied is not None:
            self._plan_copied.synchronize()

    def _planned(self) -> None:
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def _reset_step(self, out_cache_loc: torch.Tensor) -> None:
        """Forgets the previous step's plan; this step stores its K/V at `out_cache_loc`."""
        self._wrappers = {}
        self._cascade = None
        self._decode_tables = None
        self._groups_of = None
        self._ragged_step = False
        self._out_cache_loc = out_cache_loc

    def plan(self, batch: ForwardBatch) -> None:
        self._planning()
        groups = self._decode_groups(batch)  # before the reset: prefers_eager may have found them
        self._reset_step(batch.out_cache_loc)
        if batch.is_decode:
            if groups is not None and self._saved_bytes(groups) >= CASCADE_EAGER_MIN_SAVED_BYTES:
                self._plan_cascade(batch, groups)
            else:
                kv = build_paged_kv(self.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, self.page_size)
                if self._triton_decode:
                    self._decode_tables = load_decode_tables(kv, self.device, self.num_kv_heads, self._sm_count)
                else:
                    for window in self._windows:
                        self._plan_decode(self._wrapper_for(window, decode=True), kv, window)
        elif self._ragged_wrapper is not None:
            self._plan_ragged_extend(batch)
        else:
            kv = build_paged_kv(self.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, self.page_size)
            qo_indptr = qo_indptr_for(batch.extend_lens_cpu)
            for window in self._windows:
                wrapper = self._wrapper_for(window, decode=False)
                wrapper.plan(qo_indptr, kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.num_kv_heads,
                             self.head_dim, self.page_size, causal=True, sm_scale=self.scale, window_left=window,
                             logits_soft_cap=self.softcap, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
                self._wrappers[window] = wrapper
        self._planned()

    def _plan_ragged_extend(self, batch: ForwardBatch) -> None:
        """An extend over an FP8 pool: the new tokens among themselves (causal, their own K/V),
        and, when any request has a cached prefix, every request's prefix pages (non-causal: all
        of a prefix precedes all of its new tokens; an empty prefix gives an empty state)."""
        qo_indptr = qo_indptr_for(batch.extend_lens_cpu)
        self._ragged_wrapper.plan(qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads, self.head_dim, causal=True,
                                  sm_scale=self.scale, logits_soft_cap=self.softcap, q_data_type=self.dtype,
                                  kv_data_type=self.dtype)
        self._ragged_step = True
        self._ragged_prefix = any(batch.prefix_lens_cpu)
        if self._ragged_prefix:
            kv = build_paged_kv(self.req_to_token, batch.req_pool_indices_cpu, batch.prefix_lens_cpu, self.page_size)
            self.prefill.plan(qo_indptr, kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.num_kv_heads,
                              self.head_dim, self.page_size, causal=False, sm_scale=self.scale,
                              logits_soft_cap=self.softcap, q_data_type=self.dtype, kv_data_type=self.kv_dtype)

    def _wrapper_for(self, window_left: int, decode: bool):
        if window_left == -1:
            return self.decode if decode else self.prefill
        prefill, decode_wrapper = self._window_wrappers[window_left]
        return decode_wrapper if decode else prefill

    def _decode_groups(self, batch: ForwardBatch) -> CascadeGroups | None:
        """The batch's cascade groups, found once per batch (prefers_eager, then plan)."""
        if not (self.cascade and batch.is_decode):
            return None
        if self._groups_of is not None and self._groups_of[0] is batch:
            return self._groups_of[1]
        groups = find_groups(self.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, CASCADE_MIN_PREFIX,
                             self.page_size)
        self._groups_of = (batch, groups)
        return groups

    def _saved_bytes(self, groups: CascadeGroups) -> int:
        """KV bytes per layer a cascade step does not read."""
        return groups.saved_tokens * self._kv_bytes_per_token

    def _plan_cascade(self, batch: ForwardBatch, found: CascadeGroups) -> None:
        """Level 1 on the prefill wrapper (free in a decode step), level 2 on the decode wrapper."""
        tables = cascade_page_tables(self.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, found,
                                     self.page_size)
        shared = tables.shared
        self.prefill.plan(tables.qo_indptr, shared.indptr, shared.indices, shared.last_page_len, self.num_heads,
                          self.num_kv_heads, self.head_dim, self.page_size, causal=False, sm_scale=self.scale,
                          logits_soft_cap=self.softcap, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._plan_decode(self.decode, tables.own)
        order = tables.order
        reorder = inverse = None
        if order != list(range(len(order))):
            perm = np.asarray(order, dtype=np.int64)
            inv = np.empty_like(perm)
            inv[perm] = np.arange(len(perm))
            # One host-to-device copy, non-blocking: a blocking one would wait for the device.
            both = torch.from_numpy(np.stack([perm, inv])).to(self.device, non_blocking=True)
            reorder, inverse = both[0], both[1]
        self._cascade = CascadeStep(tables.num_grouped, reorder, inverse, self.decode, self.prefill)

    def _plan_decode(self, wrapper, kv: PagedKV, window_left: int = -1) -> None:
        wrapper.plan(kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.page_size, window_left=window_left, logits_soft_cap=self.softcap, sm_scale=self.scale,
                     q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._wrappers[window_left] = wrapper

    # ---- per layer -----------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.kv_pool.store(layer_id, self._out_cache_loc, k, v)
        return self._attend(q, k, v, layer_id)

    def forward_with_rotary(self, q, k, v, layer_id, positions, rotary, ops):
        """The rotation and the KV store in one Triton launch where they apply (a full-width
        rotate-half rotary with the Triton ops): one short kernel less per layer. M-RoPE's three
        position rows (a prefill over an image) take the rotary's own path."""
        if (not self.fused_rotary_store or ops.name != "triton" or rotary.rotary_dim or positions.dim() != 1
                or not self.kv_pool.fuses_rotary(q, k, v)):
            return super().forward_with_rotary(q, k, v, layer_id, positions, rotary, ops)
        self.kv_pool.rotate_and_store(layer_id, self._out_cache_loc, positions, q, k, v, rotary.cos_cache,
                                      rotary.sin_cache)
        return self._attend(q, k, v, layer_id)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Attention over the pool, this step's K/V already stored."""
        if self._ragged_step:
            return self._ragged_forward(q, k, v, layer_id)
        if self._decode_tables is not None:
            out = self._decode_tables.attend(q, self.kv_pool, layer_id, self.page_size, self.scale)
            return out.view(q.shape[0], -1)
        if self._cascade is not None:
            return self._cascade_forward(q, self.kv_pages[layer_id])
        out = self._wrappers[self._layer_window[layer_id]].run(q, self.kv_pages[layer_id], **self._kv_scales)
        return out.view(q.shape[0], -1)

    def _ragged_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if not self._ragged_prefix:
            return self._ragged_wrapper.run(q, k, v).view(q.shape[0], -1)
        out, lse = self._ragged_wrapper.run(q, k, v, return_lse=True)
        prefix_out, prefix_lse = self.prefill.run(q, self.kv_pages[layer_id], return_lse=True, **self._kv_scales)
        self._flashinfer.merge_state_in_place(out, lse, prefix_out, prefix_lse)
        return out.view(q.shape[0], -1)

    def _cascade_forward(self, q: torch.Tensor, pages) -> torch.Tensor:
        step = self._cascade
        if step.order is not None:
            q = q.index_select(0, step.order)  # level order: each group's queries contiguous
        out, lse = step.decode.run(q, pages, return_lse=True, **self._kv_scales)  # own pages (all of them, ungrouped)
        if step.merge_mask is not None:  # a graph: every row through level 1, grouped rows merged
            prefix_out, prefix_lse = step.prefix.run(q, pages, return_lse=True, **self._kv_scales)
            self._flashinfer.merge_state_in_place(out, lse, prefix_out, prefix_lse, mask=step.merge_mask)
        else:
            grouped = step.num_grouped
            prefix_out, prefix_lse = step.prefix.run(q[:grouped], pages, return_lse=True,
                                                     **self._kv_scales)  # shared prefixes
            self._flashinfer.merge_state_in_place(out[:grouped], lse[:grouped], prefix_out, prefix_lse)
        if step.inverse is not None:
            out = out.index_select(0, step.inverse)
        return out.view(out.shape[0], -1)
