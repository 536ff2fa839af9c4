"""FlashInfer paged attention (CUDA): one plan per batch, reused by every layer.

The KV pool stays head-major ([Hkv, slots, D] per layer). Viewed as pages that is
[Hkv, num_pages, page_size, D]; permuted to [num_pages, Hkv, page_size, D] it is FlashInfer's
HND layout with a head stride of `slots * D`, which its kernels accept (they read strides).
Extend batches use the paged prefill kernel with a causal mask aligned to each request's end,
so cached prefixes and new tokens are one KV sequence; decode uses the tensor-core decode
kernel (GQA groups share K/V loads). FA2 kernels throughout: they compile in ~30 s on a fresh
machine, FA3 in ~100 s.
"""

from __future__ import annotations

import torch

from radixlm.srt.attention.base import AttentionBackend
from radixlm.srt.attention.paged_kv import PagedKV, build_paged_kv, qo_indptr_for
from radixlm.srt.forward_batch import ForwardBatch
from radixlm.srt.mem_pool import KVPool

WORKSPACE_BYTES = 256 * 1024 * 1024  # split-KV partial results; FlashInfer recommends >= 128 MiB
_BACKEND = "fa2"


class FlashInferBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, page_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype):
        import flashinfer

        self._flashinfer = flashinfer
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.dtype = dtype
        self.device = kv_pool.k_buffers[0].device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=_BACKEND)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=True,
                                                                    backend=_BACKEND)
        self.kv_pages = [(_as_pages(k, page_size), _as_pages(v, page_size))
                         for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers)]
        self._wrapper = None
        self._out_cache_loc: torch.Tensor | None = None

    # ---- planning ----------------------------------------------------------------------------

    def plan(self, batch: ForwardBatch) -> None:
        kv = build_paged_kv(self.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, self.page_size)
        if batch.is_decode:
            self._plan_decode(self.decode, kv)
        else:
            self.prefill.plan(qo_indptr_for(batch.extend_lens_cpu), kv.indptr, kv.indices, kv.last_page_len,
                              self.num_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                              sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
            self._wrapper = self.prefill
        self._out_cache_loc = batch.out_cache_loc

    def _plan_decode(self, wrapper, kv: PagedKV) -> None:
        wrapper.plan(kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.page_size, sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self._wrapper = wrapper

    # ---- CUDA graphs ---------------------------------------------------------------------------

    def make_graph_decode_wrapper(self, batch_size: int, indices_buffer: torch.Tensor):
        """A decode wrapper whose page-table buffers have fixed addresses, for one captured batch
        size. All buckets can share `indices_buffer`: only one graph runs at a time."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            backend=_BACKEND)

    def plan_graph_decode(self, wrapper, batch: ForwardBatch | None, padded_size: int,
                          out_cache_loc: torch.Tensor) -> None:
        """Plans `wrapper` for `batch` padded to `padded_size` (all padding when batch is None);
        the layers then store K/V at the fixed `out_cache_loc` buffer."""
        rows, seq_lens = (batch.req_pool_indices_cpu, batch.seq_lens_cpu) if batch is not None else ([], [])
        kv = build_paged_kv(self.req_to_token, rows, seq_lens, self.page_size, padded_size)
        self._plan_decode(wrapper, kv)
        self._out_cache_loc = out_cache_loc

    # ---- per layer -----------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.kv_pool.store(layer_id, self._out_cache_loc, k, v)
        out = self._wrapper.run(q, self.kv_pages[layer_id])
        return out.view(q.shape[0], -1)


def _as_pages(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """[Hkv, slots, D] -> [num_pages, Hkv, page_size, D] as a strided view (no copy)."""
    num_kv_heads, num_slots, head_dim = buf.shape
    return buf.view(num_kv_heads, num_slots // page_size, page_size, head_dim).permute(1, 0, 2, 3)
