"""Attention whose result for a query does not depend on the batch, on how the prompt was split
into chunks, or on whether its prefix came from the cache (--enable-deterministic-inference).

Every query, in a decode step or in a prefill chunk of any size, sums over its keys in the same
order: keys in fixed blocks of KEY_BLOCK positions aligned to position 0 (block j holds
positions [j*KEY_BLOCK, (j+1)*KEY_BLOCK)); the scores and the weighted values of each block come
from products of one shape (query rows padded to a multiple of 4, batch_invariant.py says why);
the softmax subtracts the query's max over all its keys (exact in any order); and the blocks'
sums are added in position order. A key the query may not see (after it, outside its window,
past a shorter companion's end) enters with weight exactly 0, so padding and blocks of unseen
keys change no bit. K and V are always read back from the pool, so a prefix computed now and one cached by an
earlier request are the same numbers (an FP8 pool's rounding included).

Plain torch, any device; cost against the SDPA backend: bench_deterministic.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..batch_invariant import pad_rows
from ..forward_batch import ForwardBatch
from ..mem_pool import KVPool, read_kv
from .base import AttentionBackend
from .layer_spec import LOGIT_SOFTCAP, SLIDING_WINDOW, LayerAttention

KEY_BLOCK = 128
QUERY_TILE = 256  # an extend's queries attended at once: bounds the scores' memory, skips blocks ahead


class DeterministicBackend(AttentionBackend):
    SUPPORTED_FEATURES = frozenset({SLIDING_WINDOW, LOGIT_SOFTCAP})

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float,
                 layers: Sequence[LayerAttention] | None = None):
        """req_to_token: the host table (ReqToTokenTable.table, viewed as a tensor)."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.layers = list(layers) if layers is not None else [LayerAttention()] * len(kv_pool.k_buffers)
        self._batch: ForwardBatch | None = None
        self._groups: list[_Group] = []

    def plan(self, batch: ForwardBatch) -> None:
        """One-token requests attend as one group; longer extends one group each."""
        self._batch = batch
        starts = [0]
        for n in batch.extend_lens_cpu:
            starts.append(starts[-1] + n)
        single = [i for i, n in enumerate(batch.extend_lens_cpu) if n == 1]
        longer = [i for i, n in enumerate(batch.extend_lens_cpu) if n > 1]
        groups = [[i] for i in longer] + ([single] if single else [])
        self._groups = [_Group.build(batch, members, starts, self.req_to_token) for members in groups]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        pool = self.kv_pool
        pool.store(layer_id, self._batch.out_cache_loc, k, v)
        spec = self.layers[layer_id]
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group in self._groups:
            out[group.token_rows] = group.attend(q, pool.k_buffers[layer_id], pool.v_buffers[layer_id],
                                                 (pool.k_scale, pool.v_scale), self.scale, spec)
        return out


class _Group:
    """R requests with n new tokens each: their query rows, positions and key slots."""

    def __init__(self, token_rows: torch.Tensor, positions: torch.Tensor, key_slots: torch.Tensor,
                 prefix_range: tuple[int, int], shared: "_SharedBlocks | None" = None):
        self.token_rows = token_rows  # [R * n] rows of this forward, request-major
        self.positions = positions  # [R, n] each query's position
        self.prefix_range = prefix_range  # the shortest and longest prefix (host ints: no device sync)
        self.key_slots = key_slots  # [R, blocks * KEY_BLOCK]; past a request's end, its first slot
        self.shared = shared  # one-token requests whose blocks the radix cache shares

    @classmethod
    def build(cls, batch: ForwardBatch, members: list[int], starts: list[int], req_to_token: torch.Tensor) -> "_Group":
        device = batch.seq_lens.device
        n = batch.extend_lens_cpu[members[0]]
        rows = torch.tensor([starts[i] + t for i in members for t in range(n)])
        prefixes = torch.tensor([batch.prefix_lens_cpu[i] for i in members])
        positions = prefixes[:, None] + torch.arange(n)[None, :]
        seq_lens = [batch.seq_lens_cpu[i] for i in members]
        width = -(-max(seq_lens) // KEY_BLOCK) * KEY_BLOCK
        table_rows = torch.tensor([batch.req_pool_indices_cpu[i] for i in members])
        cols = torch.arange(width)[None, :].expand(len(members), width)
        inside = cols < torch.tensor(seq_lens)[:, None]
        slots = req_to_token[table_rows[:, None], torch.where(inside, cols, 0)]
        shared = _SharedBlocks.build(slots, positions[:, 0], device) if n == 1 and len(members) > 1 else None
        return cls(rows.to(device), positions.to(device), slots.to(device), (int(prefixes.min()), int(prefixes.max())),
                   shared)

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_scales: tuple[float, float],
               scale: float, spec: LayerAttention) -> torch.Tensor:
        num_reqs, n = self.positions.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_buf.shape[0]
        group = num_heads // num_kv_heads
        # Each KV head's queries as rows: [R, Hkv, group, n, D].
        queries = q[self.token_rows].view(num_reqs, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        if self.shared is not None:
            out = self.shared.attend(queries[:, :, :, 0], k_buf, v_buf, kv_scales, scale, spec)
            return out.reshape(num_reqs, num_heads * head_dim).to(q.dtype)
        out = torch.empty(num_reqs, num_kv_heads, group, n, head_dim, dtype=torch.float32, device=q.device)
        for t0 in range(0, n, QUERY_TILE):
            t1 = min(n, t0 + QUERY_TILE)
            span = (self.prefix_range[0] + t0, self.prefix_range[1] + t1 - 1)  # the tile's first and last position
            out[:, :, :, t0:t1] = self._attend_tile(queries[:, :, :, t0:t1], self.positions[:, t0:t1], span, k_buf,
                                                    v_buf, kv_scales, scale, spec)
        # [R, Hkv, group, n, D] -> [R * n, H * D]
        return out.permute(0, 3, 1, 2, 4).reshape(num_reqs * n, num_heads * head_dim).to(q.dtype)

    def _attend_tile(self, queries: torch.Tensor, positions: torch.Tensor, span: tuple[int, int], k_buf: torch.Tensor,
                     v_buf: torch.Tensor, kv_scales: tuple[float, float], scale: float,
                     spec: LayerAttention) -> torch.Tensor:
        """queries [R, Hkv, group, rows, D] at `positions` [R, rows] -> [R, Hkv, group, rows, D]
        in float32, over every key block any of them sees."""
        num_reqs, num_kv_heads, group, rows, head_dim = queries.shape
        f32 = torch.float32
        first = 0
        if spec.sliding_window is not None:
            first = max(0, span[0] - spec.sliding_window + 1) // KEY_BLOCK * KEY_BLOCK
        end = (span[1] // KEY_BLOCK + 1) * KEY_BLOCK
        blocks = (end - first) // KEY_BLOCK
        slots = self.key_slots[:, first:end].reshape(-1)
        shape = (num_kv_heads, num_reqs, blocks, KEY_BLOCK, head_dim)
        keys = read_kv(k_buf, slots, f32, kv_scales[0]).view(shape).transpose(0, 1)  # [R, Hkv, blocks, KB, D]
        values = read_kv(v_buf, slots, f32, kv_scales[1]).view(shape).transpose(0, 1)
        flat_q = pad_rows(queries.reshape(num_reqs, num_kv_heads, group * rows, head_dim).to(f32), 2)
        # One product per key block: [R, Hkv, blocks, rows', KB], each of the same shape.
        scores = torch.matmul(flat_q[:, :, None], keys.transpose(-1, -2))[..., :group * rows, :]
        scores = scores.reshape(num_reqs, num_kv_heads, blocks, group, rows, KEY_BLOCK)
        key_pos = torch.arange(first, end, device=queries.device).view(blocks, 1, KEY_BLOCK)
        scores = _masked_scores(scores, key_pos, positions[:, None, :, None], scale, spec)  # seen: [R, blocks, rows, KB]
        # The max is exact in any order; every query sees at least its own key.
        top = scores.amax(dim=(2, 5), keepdim=True)
        weights = scores.sub_(top).exp_()  # in place: these are the tile's largest tensors
        flat_w = pad_rows(weights.reshape(num_reqs, num_kv_heads, blocks, group * rows, KEY_BLOCK), 3)
        products = torch.matmul(flat_w, values)  # [R, Hkv, blocks, rows padded, D]
        totals, acc = _sum_blocks_in_order(weights.sum(dim=-1), products, dim=2)  # totals: [R, Hkv, group, rows]
        acc = acc[:, :, :group * rows].view(num_reqs, num_kv_heads, group, rows, head_dim)
        return acc / totals[..., None]


class _SharedBlocks:
    """Decode attention for requests whose key blocks the radix cache shares (few-shot
    examples, a system prompt, the trunk of a fork: the very same KV slots). Each distinct
    block is read once, and its products take the queries of every request that holds it as
    rows of one product. A product's rows do not depend on each other, and each (request,
    block) pair's sums come out as in _Group._attend_tile, which then adds them in position
    order the same way, so the answer is the same bits as reading the block per request.

    Blocks are bucketed by how many requests hold them (1, 2, 3-4, 5-8, ...), each bucket's
    member lists padded to its largest with a row that sees nothing."""

    def __init__(self, buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                 num_blocks: int):
        self.buckets = buckets  # (members [u, C] (R = padding), block index [u], slots [u, KEY_BLOCK])
        self.positions = positions  # [R + 1]: each request's query position, and -1 for the padding row
        self.num_blocks = num_blocks

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor, device: torch.device) -> "_SharedBlocks | None":
        """slots: [R, blocks * KEY_BLOCK] host slots; None when no two requests share a block."""
        num_reqs, width = slots.shape
        num_blocks = width // KEY_BLOCK
        blocks = slots.view(num_reqs, num_blocks, KEY_BLOCK)
        by_size: dict[int, list[tuple[list[int], int]]] = {}
        distinct = 0
        for block in range(num_blocks):
            _, owner = torch.unique(blocks[:, block], dim=0, return_inverse=True)
            for holder in range(int(owner.max()) + 1):
                members = (owner == holder).nonzero()[:, 0].tolist()
                size = 1 << (len(members) - 1).bit_length()  # 1, 2, 4, 8, ...
                by_size.setdefault(size, []).append((members, block))
                distinct += 1
        if distinct == num_reqs * num_blocks:
            return None
        buckets = []
        for size, entries in sorted(by_size.items()):
            members = torch.tensor([m + [num_reqs] * (size - len(m)) for m, _ in entries])
            index = torch.tensor([block for _, block in entries])
            block_slots = blocks[torch.tensor([m[0] for m, _ in entries]), index]
            buckets.append((members.to(device), index.to(device), block_slots.to(device)))
        padded = torch.cat([positions, torch.tensor([-1])])
        return cls(buckets, padded.to(device), num_blocks)

    def attend(self, queries: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_scales: tuple[float, float],
               scale: float, spec: LayerAttention) -> torch.Tensor:
        """queries [R, Hkv, group, D] -> [R, Hkv, group, D] in float32."""
        num_reqs, num_kv_heads, group, head_dim = queries.shape
        f32 = torch.float32
        padded_q = torch.cat([queries.to(f32), queries.new_zeros(1, num_kv_heads, group, head_dim, dtype=f32)])
        block_top = torch.full((num_reqs + 1, self.num_blocks, num_kv_heads, group), float("-inf"), device=queries.device)
        scored = []
        for members, index, slots in self.buckets:
            count, size = members.shape
            rows = pad_rows(padded_q[members].permute(0, 2, 1, 3, 4).reshape(count, num_kv_heads, size * group,
                                                                              head_dim), 2)
            shape = (num_kv_heads, count, KEY_BLOCK, head_dim)
            keys = read_kv(k_buf, slots.reshape(-1), f32, kv_scales[0]).view(shape).transpose(0, 1)
            values = read_kv(v_buf, slots.reshape(-1), f32, kv_scales[1]).view(shape).transpose(0, 1)
            scores = torch.matmul(rows, keys.transpose(-1, -2))[:, :, :size * group]
            scores = scores.reshape(count, num_kv_heads, size, group, KEY_BLOCK)
            key_pos = index[:, None, None] * KEY_BLOCK + torch.arange(KEY_BLOCK, device=index.device)  # [u, 1, KB]
            scores = _masked_scores(scores, key_pos, self.positions[members][:, :, None], scale, spec)  # seen: [u, C, KB]
            block_top[members, index[:, None]] = scores.amax(dim=-1).transpose(1, 2)
            scored.append((members, index, scores, values))
        top = block_top.amax(dim=1)  # [R + 1, Hkv, group]: exact in any order
        sums = torch.zeros(num_reqs + 1, self.num_blocks, num_kv_heads, group, device=queries.device)
        products = torch.zeros(num_reqs + 1, self.num_blocks, num_kv_heads, group, head_dim, device=queries.device)
        for members, index, scores, values in scored:
            count, size = members.shape
            weights = scores.sub_(top[members].transpose(1, 2)[..., None]).exp_()
            sums[members, index[:, None]] = weights.sum(dim=-1).transpose(1, 2)
            flat = pad_rows(weights.reshape(count, num_kv_heads, size * group, KEY_BLOCK), 2)
            out = torch.matmul(flat, values)[:, :, :size * group].view(count, num_kv_heads, size, group, head_dim)
            products[members, index[:, None]] = out.transpose(1, 2)
        totals, acc = _sum_blocks_in_order(sums[:num_reqs], products[:num_reqs], dim=1)
        return acc / totals[..., None]


def _masked_scores(scores: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, scale: float,
                   spec: LayerAttention) -> torch.Tensor:
    """Scaled (and soft-capped) scores, -inf where the query may not see the key, in place. `scores` is
    [N, Hkv, A, group, B, KB] or [N, Hkv, A, group, KB], and the positions broadcast to
    [N, A, (B,) KB], the mask's shape without the KV-head and group axes."""
    scores.mul_(scale)  # in place: `scores` is a fresh product, and each pass allocates ~MBs
    if spec.logit_softcap is not None:
        scores.div_(spec.logit_softcap).tanh_().mul_(spec.logit_softcap)
    seen = key_pos <= query_pos
    if spec.sliding_window is not None:
        seen &= key_pos > query_pos - spec.sliding_window
    return scores.masked_fill_(~seen[:, None, :, None], float("-inf"))


def _sum_blocks_in_order(sums: torch.Tensor, products: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax denominators, weighted values) summed over the blocks axis `dim` in position
    order: the sums by a scan, the values block by block. Both paths go through here, so both
    add in one order; blocks of zeros before or after a query's keys change nothing."""
    totals = sums.cumsum(dim=dim).select(dim, -1)
    acc = products.select(dim, 0).clone()
    for block in range(1, products.shape[dim]):
        acc += products.select(dim, block)
    return totals, acc
