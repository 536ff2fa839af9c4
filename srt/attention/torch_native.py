"""Reference attention in plain torch (any device): gathers each request's K/V from the pool.

Decode batches where requests share a long cached prefix (few-shot examples, a system prompt,
the trunk of a fork: the radix cache gives them the very same KV slots) use cascade attention:
the shared prefix is read once per group, not once per request, and merged with each request's
own suffix through their softmax statistics.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from radixlm.srt.attention.base import AttentionBackend
from radixlm.srt.forward_batch import ForwardBatch
from radixlm.srt.mem_pool import KVPool

# Requests sharing fewer KV slots than this are attended one by one (no cascade).
CASCADE_MIN_PREFIX = 64


class TorchNativeBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float):
        """req_to_token: the host table (ReqToTokenPool.table); rows are copied per batch."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self._batch: ForwardBatch | None = None
        self._decode_slots: torch.Tensor | None = None  # [B, max_len]
        self._decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_len] or None
        self._extend_plan: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        self._cascade: _CascadePlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            device = batch.seq_lens.device
            host_slots = self.req_to_token[batch.req_pool_indices_cpu, :max_len]
            self._cascade = _CascadePlan.build(host_slots, batch.seq_lens_cpu, device)
            if self._cascade is not None:
                return
            self._decode_slots = host_slots.to(device)
            if min(batch.seq_lens_cpu) == max_len:
                self._decode_mask = None
            else:
                cols = torch.arange(max_len, device=batch.seq_lens.device)
                self._decode_mask = (cols[None, :] < batch.seq_lens[:, None])[:, None, None, :]
            return
        # Extend: per request, (start row, new tokens, KV slots of the whole sequence, mask).
        self._extend_plan = []
        start = 0
        rows = batch.req_pool_indices_cpu
        for row, prefix_len, extend_len in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            if prefix_len == 0:
                self._extend_plan.append((start, extend_len, None, None))
            else:
                seq_len = prefix_len + extend_len
                slots = self.req_to_token[row, :seq_len].to(batch.seq_lens.device)
                q_pos = torch.arange(prefix_len, seq_len, device=slots.device)
                mask = torch.arange(seq_len, device=slots.device)[None, :] <= q_pos[:, None]
                self._extend_plan.append((start, extend_len, slots, mask))
            start += extend_len

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        batch = self._batch
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        if batch.is_decode and self._cascade is not None:
            return self._cascade.attend(q, k_buf, v_buf, self.scale)
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



class _CascadePlan:
    """Decode attention as (shared prefix per group) + (own suffix per request)."""

    def __init__(self, groups: list[tuple[torch.Tensor, torch.Tensor]], suffix_slots: torch.Tensor,
                 suffix_mask: torch.Tensor):
        self.groups = groups  # (request indices [G], prefix KV slots [P]) per group
        self.suffix_slots = suffix_slots  # [B, S], padded
        self.suffix_mask = suffix_mask  # [B, 1, 1, S]: True where a real token is

    @classmethod
    def build(cls, slots: torch.Tensor, seq_lens: list[int], device: torch.device) -> "_CascadePlan | None":
        """Groups requests that share at least CASCADE_MIN_PREFIX KV slots; None when none do.

        A cached slot's KV depends on every token before it, so requests holding the same slot
        at position CASCADE_MIN_PREFIX - 1 share all the slots up to it: that slot is the key."""
        key_pos = CASCADE_MIN_PREFIX - 1
        by_key: dict[int, list[int]] = defaultdict(list)
        if slots.shape[1] > key_pos:
            for i, key in enumerate(slots[:, key_pos].tolist()):
                if seq_lens[i] > CASCADE_MIN_PREFIX:
                    by_key[key].append(i)
        prefix_of = [0] * len(seq_lens)
        groups = []
        for members in by_key.values():
            if len(members) < 2:
                continue
            # Every request keeps at least its newest token (its own slot) in the suffix.
            limit = min(seq_lens[i] for i in members) - 1
            rows = slots[members, :limit]
            same = (rows == rows[:1]).all(dim=0)
            shared = limit if bool(same.all()) else int(same.to(torch.int8).argmin())
            if shared < CASCADE_MIN_PREFIX:
                continue
            groups.append((torch.tensor(members, device=device), slots[members[0], :shared].to(device)))
            for i in members:
                prefix_of[i] = shared
        if not groups:
            return None
        suffix_lens = [n - p for n, p in zip(seq_lens, prefix_of)]
        width = max(suffix_lens)
        cols = torch.arange(width)
        starts = torch.tensor(prefix_of)
        index = (starts[:, None] + cols[None, :]).clamp(max=slots.shape[1] - 1)
        suffix = torch.gather(slots, 1, index)
        mask = cols[None, :] < torch.tensor(suffix_lens)[:, None]
        return cls(groups, suffix.to(device), mask[:, None, None, :].to(device))

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
        num_reqs, width = self.suffix_slots.shape
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        queries = q.view(num_reqs, num_kv_heads, -1, head_dim).float()  # [B, Hkv, group, D]
        flat = self.suffix_slots.reshape(-1)
        keys = k_buf.index_select(1, flat).view(num_kv_heads, num_reqs, width, head_dim).transpose(0, 1)
        values = v_buf.index_select(1, flat).view(num_kv_heads, num_reqs, width, head_dim).transpose(0, 1)
        scores = (queries @ keys.float().transpose(-1, -2)) * scale  # [B, Hkv, group, S]
        scores = scores.masked_fill(~self.suffix_mask, float("-inf"))
        top, total, out = _partial_softmax(scores, values.float())
        group_size = queries.shape[2]
        for members, prefix_slots in self.groups:
            count = members.numel()
            # All the group's queries against the prefix at once: [Hkv, G*group, P].
            gq = queries.index_select(0, members).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
            pk = k_buf.index_select(1, prefix_slots).float()
            pv = v_buf.index_select(1, prefix_slots).float()
            p_top, p_total, p_out = _partial_softmax((gq @ pk.transpose(-1, -2)) * scale, pv)
            regroup = lambda t: t.view(num_kv_heads, count, group_size, -1).permute(1, 0, 2, 3)  # noqa: E731
            p_top, p_total, p_out = regroup(p_top), regroup(p_total), regroup(p_out)
            s_top, s_total, s_out = top[members], total[members], out[members]
            new_top = torch.maximum(s_top, p_top)
            a, b = torch.exp(s_top - new_top), torch.exp(p_top - new_top)
            top[members] = new_top
            total[members] = s_total * a + p_total * b
            out[members] = s_out * a + p_out * b
        return (out / total).reshape(num_reqs, -1).to(q.dtype)


def _partial_softmax(scores: torch.Tensor, values: torch.Tensor):
    """(max, sum of exp, unnormalized output) of softmax(scores) @ values over the last axis."""
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top)
    return top, weights.sum(dim=-1, keepdim=True), weights @ values
