"""Reference attention in plain torch (any device): gathers each request's K/V from the pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.srt.attention.base import AttentionBackend
from radixlm.srt.forward_batch import ForwardBatch
from radixlm.srt.mem_pool import KVPool


class TorchNativeBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self._batch: ForwardBatch | None = None
        self._decode_slots: torch.Tensor | None = None  # [B, max_len]
        self._decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_len] or None
        self._extend_plan: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            self._decode_slots = self.req_to_token[batch.req_pool_indices, :max_len]
            if min(batch.seq_lens_cpu) == max_len:
                self._decode_mask = None
            else:
                cols = torch.arange(max_len, device=batch.seq_lens.device)
                self._decode_mask = (cols[None, :] < batch.seq_lens[:, None])[:, None, None, :]
            return
        # Extend: per request, (start row, new tokens, KV slots of the whole sequence, mask).
        self._extend_plan = []
        start = 0
        rows = batch.req_pool_indices.tolist()
        for row, prefix_len, extend_len in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            if prefix_len == 0:
                self._extend_plan.append((start, extend_len, None, None))
            else:
                seq_len = prefix_len + extend_len
                slots = self.req_to_token[row, :seq_len]
                q_pos = torch.arange(prefix_len, seq_len, device=slots.device)
                mask = torch.arange(seq_len, device=slots.device)[None, :] <= q_pos[:, None]
                self._extend_plan.append((start, extend_len, slots, mask))
            start += extend_len

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        batch = self._batch
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        if batch.is_decode:
            # One query per request: fold each KV head's query group into the query-length axis,
            # so SDPA sees plain multi-head attention ([B, Hkv, group, D] against [B, Hkv, L, D]).
            num_reqs, max_len = self._decode_slots.shape
            flat = self._decode_slots.reshape(-1)
            num_kv_heads, head_dim = k.shape[1], k.shape[2]
            # [Hkv, B*L, D] -> [B, Hkv, L, D] as a strided view (SDPA reads it without a copy).
            keys = k_buf.index_select(1, flat).view(num_kv_heads, num_reqs, max_len, head_dim).transpose(0, 1)
            values = v_buf.index_select(1, flat).view(num_kv_heads, num_reqs, max_len, head_dim).transpose(0, 1)
            grouped_q = q.view(num_reqs, num_kv_heads, -1, head_dim).to(keys.dtype)
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=self._decode_mask, scale=self.scale)
            return out.reshape(num_reqs, -1).to(q.dtype)
        outs = []
        for start, extend_len, slots, mask in self._extend_plan:
            # SDPA on CPU is only fast for contiguous [heads, tokens, head_dim] inputs.
            qi = q[start:start + extend_len].transpose(0, 1).contiguous()
            if slots is None:  # nothing cached: the new tokens are the whole sequence
                ki = k[start:start + extend_len].transpose(0, 1).contiguous()
                vi = v[start:start + extend_len].transpose(0, 1).contiguous()
                oi = _sdpa(qi, ki, vi, is_causal=True, scale=self.scale)
            else:
                ki = k_buf.index_select(1, slots).to(q.dtype)  # [Hkv, seq_len, D]
                vi = v_buf.index_select(1, slots).to(q.dtype)
                oi = _sdpa(qi, ki, vi, attn_mask=mask, scale=self.scale)
            outs.append(oi.transpose(0, 1).reshape(extend_len, -1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA for one request's [heads, tokens, head_dim] tensors. A leading batch axis matters:
    on CPU, 3-D inputs take the slow math kernel and 4-D ones the flash kernel (3-5x faster)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kwargs)[0]

