"""Reference attention in plain torch (any device): gathers each request's K/V from the pool.

One-token requests (a decode batch, or decodes riding in an extend batch) attend together;
longer extends attend one by one. One-token requests that share a long cached prefix (few-shot
examples, a system prompt, the trunk of a fork: the radix cache gives them the very same KV
slots) use cascade attention: the shared prefix is read once per group, not once per request,
and merged with each request's own suffix through their softmax statistics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.srt.executor.attention.base import AttentionBackend
from radixlm.srt.executor.attention.cascade_groups import CASCADE_MIN_PREFIX, find_groups
from radixlm.srt.executor.forward_batch import ForwardBatch
from radixlm.srt.executor.mem_pool import KVPool


class TorchNativeBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float, cascade: bool = True):
        """req_to_token: the host table (ReqToTokenTable.table, viewed as a tensor); rows are copied per batch.
        cascade: False attends every one-token request on its own (--disable-cascade-attention)."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.cascade = cascade
        self._batch: ForwardBatch | None = None
        # One-token requests (all of a decode batch; decodes riding in an extend batch), and
        # the token rows they own in this forward.
        self._decode: _PlainDecode | _CascadePlan | None = None
        self._decode_rows: torch.Tensor | None = None
        # Longer extends, one by one: (start row, new tokens, KV slots of the sequence, mask).
        self._extend_plan: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch
        device = batch.seq_lens.device
        self._extend_plan = []
        starts = [0]
        for extend_len in batch.extend_lens_cpu:
            starts.append(starts[-1] + extend_len)
        single = [i for i, (p, n) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)) if n == 1 and p > 0]
        self._decode = self._decode_rows = None
        if single:
            rows = [batch.req_pool_indices_cpu[i] for i in single]
            seq_lens = [batch.seq_lens_cpu[i] for i in single]
            host_slots = self.req_to_token[rows, :max(seq_lens)]
            self._decode = ((self.cascade and _CascadePlan.build(host_slots, seq_lens, device))
                            or _PlainDecode(host_slots.to(device), seq_lens, device))
            self._decode_rows = torch.tensor([starts[i] for i in single], device=device)
        single_set = set(single)
        for i, (row, prefix_len, extend_len) in enumerate(zip(batch.req_pool_indices_cpu, batch.prefix_lens_cpu,
                                                              batch.extend_lens_cpu)):
            if i in single_set:
                continue
            if prefix_len == 0:
                self._extend_plan.append((starts[i], extend_len, None, None))
            else:
                seq_len = prefix_len + extend_len
                slots = self.req_to_token[row, :seq_len].to(device)
                q_pos = torch.arange(prefix_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                self._extend_plan.append((starts[i], extend_len, slots, mask))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        batch = self._batch
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        if not self._extend_plan:  # a decode batch, or an extend batch of one-token requests
            return self._decode.attend(q, k_buf, v_buf, self.scale)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if self._decode is not None:
            out[self._decode_rows] = self._decode.attend(q[self._decode_rows], k_buf, v_buf, self.scale)
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
            out[start:start + extend_len] = oi.transpose(0, 1).reshape(extend_len, -1)
        return out


class _PlainDecode:
    """One query per request against its own gathered K/V."""

    def __init__(self, slots: torch.Tensor, seq_lens: list[int], device: torch.device):
        self.slots = slots  # [B, max_len]
        max_len = slots.shape[1]
        self.mask = None  # [B, 1, 1, max_len] when lengths differ
        if min(seq_lens) != max_len:
            cols = torch.arange(max_len, device=device)
            self.mask = (cols[None, :] < torch.tensor(seq_lens, device=device)[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
        # Fold each KV head's query group into the query-length axis, so SDPA sees plain
        # multi-head attention ([B, Hkv, group, D] against [B, Hkv, L, D]).
        num_reqs, max_len = self.slots.shape
        flat = self.slots.reshape(-1)
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        # [Hkv, B*L, D] -> [B, Hkv, L, D] as a strided view (SDPA reads it without a copy).
        keys = k_buf.index_select(1, flat).view(num_kv_heads, num_reqs, max_len, head_dim).transpose(0, 1)
        values = v_buf.index_select(1, flat).view(num_kv_heads, num_reqs, max_len, head_dim).transpose(0, 1)
        grouped_q = q.reshape(num_reqs, num_kv_heads, -1, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=self.mask, scale=scale)
        return out.reshape(num_reqs, -1).to(q.dtype)


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
        """Groups requests that share at least CASCADE_MIN_PREFIX KV slots (see
        cascade_groups.find_groups); None when none do. slots: [B, max_len] host rows."""
        found = find_groups(slots, range(len(seq_lens)), seq_lens, CASCADE_MIN_PREFIX)
        if found is None:
            return None
        groups = [(torch.tensor(g.members, device=device), slots[g.members[0], :g.prefix_len].to(device))
                  for g in found.groups]
        prefix_of = found.prefix_lens
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
        queries = q.reshape(num_reqs, num_kv_heads, -1, head_dim).float()  # [B, Hkv, group, D]
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
