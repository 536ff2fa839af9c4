"""Reference attention in plain torch (any device): gathers each request's K/V from the pool.

One-token requests (a decode batch, or decodes riding in an extend batch) attend together;
longer extends attend one by one. One-token requests that share a long cached prefix (few-shot
examples, a system prompt, the trunk of a fork: the radix cache gives them the very same KV
slots) use cascade attention: the shared prefix is read once per group, not once per request,
and merged with each request's own suffix through their softmax statistics.

Per layer (layer_spec.LayerAttention): a sliding window (one plan per distinct window per
batch) and soft-capped scores (Gemma 2; computed without SDPA, which cannot cap).

With an FP8 pool an extend in a layer without a window attends its new tokens' K/V as computed
and reads only the cached prefix back from the pool (rounded to e4m3), as the FlashInfer
backend's ragged prefill does; one-token requests and windowed layers read everything back from
the pool, as FlashInfer's decode and windowed prefill do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch
from ..mem_pool import FP8_KV_DTYPE, KVPool, read_kv
from .base import AttentionBackend
from .cascade_groups import CASCADE_MIN_PREFIX, find_groups
from .layer_spec import LOGIT_SOFTCAP, SLIDING_WINDOW, LayerAttention


class TorchNativeBackend(AttentionBackend):
    SUPPORTED_FEATURES = frozenset({SLIDING_WINDOW, LOGIT_SOFTCAP})

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float, cascade: bool = True,
                 layers: Sequence[LayerAttention] | None = None):
        """req_to_token: the host table (ReqToTokenTable.table, viewed as a tensor); rows are copied per batch.
        cascade: False attends every one-token request on its own (--disable-cascade-attention).
        layers: each layer's window and soft-cap (plain causal attention everywhere when None)."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.cascade = cascade
        self.layers = list(layers) if layers is not None else [LayerAttention()] * len(kv_pool.k_buffers)
        # One plan per distinct window per batch; every layer with that window shares it.
        self._windows = sorted({spec.sliding_window for spec in self.layers}, key=lambda w: -1 if w is None else w)
        self._batch: ForwardBatch | None = None
        self._plans: dict[int | None, _StepPlan] = {}

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._plans = {window: _StepPlan.build(batch, self.req_to_token, window, self.cascade and window is None)
                       for window in self._windows}

    @property
    def _decode(self) -> "_PlainDecode | _CascadePlan | None":
        """The one-token requests' plan of the full-attention layers (cascade or plain)."""
        plan = self._plans.get(None)
        return plan.decode if plan is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.kv_pool.store(layer_id, self._batch.out_cache_loc, k, v)
        spec = self.layers[layer_id]
        pool = self.kv_pool
        return self._plans[spec.sliding_window].attend(q, k, v, pool.k_buffers[layer_id], pool.v_buffers[layer_id],
                                                       self.scale, spec.logit_softcap, (pool.k_scale, pool.v_scale))


class _StepPlan:
    """One batch's attention plan for layers with one window (None: full causal attention).

    One-token requests (all of a decode batch; decodes riding in an extend batch) attend
    together, longer extends one by one. With a window, a query at position p sees keys at
    positions p - window + 1 .. p only: decodes gather just those slots, extends a banded mask
    over the slots from the first one any of their queries sees. KV beyond the window stays in
    the pool (the radix cache may share it with a full-attention layer or a later request).
    """

    def __init__(self, decode, decode_rows, extends, window: int | None = None):
        self.window = window
        self.decode: _PlainDecode | _CascadePlan | None = decode
        self.decode_rows: torch.Tensor | None = decode_rows  # the token rows they own in this forward
        # Longer extends, one by one: (start row, new tokens, KV slots of the keys or None when
        # they are exactly the new tokens, boolean mask [new tokens, keys] or None for causal).
        self.extends: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = extends

    @classmethod
    def build(cls, batch: ForwardBatch, req_to_token: torch.Tensor, window: int | None, cascade: bool) -> "_StepPlan":
        device = batch.seq_lens.device
        starts = [0]
        for extend_len in batch.extend_lens_cpu:
            starts.append(starts[-1] + extend_len)
        single = [i for i, (p, n) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)) if n == 1 and p > 0]
        decode = decode_rows = None
        if single:
            rows = [batch.req_pool_indices_cpu[i] for i in single]
            seq_lens = [batch.seq_lens_cpu[i] for i in single]
            if window is None:
                host_slots = req_to_token[rows, :max(seq_lens)]
                decode = ((cascade and _CascadePlan.build(host_slots, seq_lens, device))
                          or _PlainDecode(host_slots.to(device), seq_lens, device))
            else:
                kv_starts = [max(0, n - window) for n in seq_lens]
                decode = _PlainDecode(_gather_slots(req_to_token, rows, kv_starts, seq_lens).to(device),
                                      [n - s for n, s in zip(seq_lens, kv_starts)], device)
            decode_rows = torch.tensor([starts[i] for i in single], device=device)
        single_set = set(single)
        extends = []
        for i, (row, prefix_len, extend_len) in enumerate(zip(batch.req_pool_indices_cpu, batch.prefix_lens_cpu,
                                                              batch.extend_lens_cpu)):
            if i in single_set:
                continue
            seq_len = prefix_len + extend_len
            if prefix_len == 0 and (window is None or extend_len <= window):
                extends.append((starts[i], extend_len, None, None))  # plain causal over the new tokens
                continue
            kv_start = 0 if window is None else max(0, prefix_len - window + 1)
            slots = req_to_token[row, kv_start:seq_len].to(device) if prefix_len else None
            mask = _causal_mask(prefix_len, seq_len, kv_start, window, device)
            extends.append((starts[i], extend_len, slots, mask))
        return cls(decode, decode_rows, extends, window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               scale: float, softcap: float | None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """kv_scales: what an FP8 pool's K and V are multiplied by when read (1.0 otherwise)."""
        if not self.extends:  # a decode batch, or an extend batch of one-token requests
            return self.decode.attend(q, k_buf, v_buf, scale, softcap, kv_scales)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if self.decode is not None:
            rows = self.decode_rows
            out[rows] = self.decode.attend(q[rows], k_buf, v_buf, scale, softcap, kv_scales)
        for start, extend_len, slots, mask in self.extends:
            # SDPA on CPU is only fast for contiguous [heads, tokens, head_dim] inputs.
            qi = q[start:start + extend_len].transpose(0, 1).contiguous()
            if slots is None:  # nothing cached: the new tokens are the whole sequence
                ki = k[start:start + extend_len].transpose(0, 1).contiguous()
                vi = v[start:start + extend_len].transpose(0, 1).contiguous()
            elif k_buf.dtype == FP8_KV_DTYPE and self.window is None:  # cached keys from the pool, new ones unrounded
                cached = slots[:-extend_len]
                ki = torch.cat([read_kv(k_buf, cached, q.dtype, kv_scales[0]),  # [Hkv, keys, D]
                                k[start:start + extend_len].transpose(0, 1).to(q.dtype)], dim=1)
                vi = torch.cat([read_kv(v_buf, cached, q.dtype, kv_scales[1]),
                                v[start:start + extend_len].transpose(0, 1).to(q.dtype)], dim=1)
            else:
                ki = read_kv(k_buf, slots, q.dtype, kv_scales[0])  # [Hkv, keys, D]
                vi = read_kv(v_buf, slots, q.dtype, kv_scales[1])
            if softcap is not None:
                if mask is None:
                    mask = torch.ones(extend_len, extend_len, dtype=torch.bool, device=q.device).tril()
                oi = _softcap_extend(qi, ki, vi, mask, scale, softcap)
            elif mask is None:
                oi = _sdpa(qi, ki, vi, is_causal=True, scale=scale)
            else:
                oi = _sdpa(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start:start + extend_len] = oi.transpose(0, 1).reshape(extend_len, -1)
        return out


def _causal_mask(prefix_len: int, seq_len: int, kv_start: int, window: int | None,
                 device: torch.device) -> torch.Tensor:
    """[queries at prefix_len..seq_len-1, keys at kv_start..seq_len-1]: True where attended."""
    q_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(kv_start, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _gather_slots(req_to_token: torch.Tensor, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
    """[B, max(end - start)] host slots: row i holds req_to_token[rows[i], starts[i]:ends[i]],
    padded by repeating its last slot (masked out by the caller)."""
    width = max(e - s for s, e in zip(starts, ends))
    begin = torch.tensor(starts)[:, None]
    cols = (begin + torch.arange(width)[None, :]).minimum(torch.tensor(ends)[:, None] - 1)
    return req_to_token[torch.tensor(rows)[:, None], cols]


class _PlainDecode:
    """One query per request against its own gathered K/V."""

    def __init__(self, slots: torch.Tensor, seq_lens: list[int], device: torch.device):
        self.slots = slots  # [B, max_len]
        max_len = slots.shape[1]
        self.mask = None  # [B, 1, 1, max_len] when lengths differ
        if min(seq_lens) != max_len:
            cols = torch.arange(max_len, device=device)
            self.mask = (cols[None, :] < torch.tensor(seq_lens, device=device)[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float,
               softcap: float | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        # Fold each KV head's query group into the query-length axis, so SDPA sees plain
        # multi-head attention ([B, Hkv, group, D] against [B, Hkv, L, D]).
        num_reqs, max_len = self.slots.shape
        flat = self.slots.reshape(-1)
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        # [Hkv, B*L, D] -> [B, Hkv, L, D] as a strided view (SDPA reads it without a copy).
        shape = (num_kv_heads, num_reqs, max_len, head_dim)
        keys = read_kv(k_buf, flat, q.dtype, kv_scales[0]).view(shape).transpose(0, 1)
        values = read_kv(v_buf, flat, q.dtype, kv_scales[1]).view(shape).transpose(0, 1)
        grouped_q = q.reshape(num_reqs, num_kv_heads, -1, head_dim).to(keys.dtype)
        if softcap is None:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=self.mask, scale=scale)
        else:
            out = _softcap_attention(grouped_q, keys, values, self.mask, scale, softcap)
        return out.reshape(num_reqs, -1).to(q.dtype)


def _softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA cannot cap), in fp32 as transformers' eager
    path: scores * scale, then cap * tanh(scores / cap), then the mask. q: [..., R, D],
    k/v: [..., L, D], mask broadcastable to [..., R, L] (True: attend)."""
    scores = _cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _softcap_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    softcap: float) -> torch.Tensor:
    """One request's soft-capped attention: q [H, n, D], k/v [Hkv, L, D], mask [n, L]. Each KV
    head's query group is folded into the rows ([Hkv, G*n, D]) instead of repeating K/V."""
    num_heads, n, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    out = _softcap_attention(q.reshape(num_kv_heads, group * n, head_dim), k, v, mask.repeat(group, 1), scale, softcap)
    return out.view(num_heads, n, head_dim)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


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

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float,
               softcap: float | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        num_reqs, width = self.suffix_slots.shape
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        queries = q.reshape(num_reqs, num_kv_heads, -1, head_dim).float()  # [B, Hkv, group, D]
        flat = self.suffix_slots.reshape(-1)
        f32 = torch.float32
        keys = read_kv(k_buf, flat, f32, kv_scales[0]).view(num_kv_heads, num_reqs, width, head_dim).transpose(0, 1)
        values = read_kv(v_buf, flat, f32, kv_scales[1]).view(num_kv_heads, num_reqs, width, head_dim).transpose(0, 1)
        scores = _cap((queries @ keys.float().transpose(-1, -2)) * scale, softcap)  # [B, Hkv, group, S]
        scores = scores.masked_fill(~self.suffix_mask, float("-inf"))
        top, total, out = _partial_softmax(scores, values.float())
        group_size = queries.shape[2]
        for members, prefix_slots in self.groups:
            count = members.numel()
            # All the group's queries against the prefix at once: [Hkv, G*group, P].
            gq = queries.index_select(0, members).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
            pk = read_kv(k_buf, prefix_slots, f32, kv_scales[0])
            pv = read_kv(v_buf, prefix_slots, f32, kv_scales[1])
            p_top, p_total, p_out = _partial_softmax(_cap((gq @ pk.transpose(-1, -2)) * scale, softcap), pv)
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
