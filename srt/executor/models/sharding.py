"""How a model splits across tensor-parallel ranks, and which part of each checkpoint tensor a
rank reads.

Attention splits by KV-head group: a rank holds some KV heads and the query heads that read
them, so attention needs no communication. With fewer KV heads than ranks, each KV head is
replicated on `size / num_kv_heads` ranks and its query heads are divided among them. With
more, the groups are spread as evenly as they go (SmolLM2's 3 KV heads on 2 ranks: 2 and 1):
uneven, but every model whose heads cannot be divided evenly still runs. The MLP (and each
expert) splits its intermediate dimension; the embedding and the LM head split the vocabulary
into equal blocks, the last one padded. Projections into a split dimension are column
parallel, the ones out of it (o_proj, down_proj) row parallel: one all-reduce after each.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ...configs import ModelConfig

# A piece of a checkpoint tensor: rows (dim 0) or columns (dim 1) [start, stop).
Piece = tuple[int, int, int]

_EXPERT_RE = re.compile(r".*experts\.\d+\.(\w+)\.weight")


def _even(n: int, size: int, rank: int) -> tuple[int, int]:
    return rank * n // size, (rank + 1) * n // size


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: the ranges of heads, MLP columns and vocabulary it holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    moe_intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the full vocabulary this rank holds (the last block may be short)
    vocab_block: int  # rows every rank's embedding has (padded)
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> "ShardPlan":
        check_tp_size(config, size)
        heads, kv_heads = config.num_heads, config.num_kv_heads
        group = heads // kv_heads
        if size <= kv_heads:
            kv = _even(kv_heads, size, rank)
            q = (kv[0] * group, kv[1] * group)
        else:  # each KV head on size / kv_heads ranks, its query heads divided among them
            copies = size // kv_heads
            head = rank // copies
            kv = (head, head + 1)
            per_rank = group // copies
            first = head * group + (rank % copies) * per_rank
            q = (first, first + per_rank)
        block = -(-config.vocab_size // size)
        vocab = (min(rank * block, config.vocab_size), min((rank + 1) * block, config.vocab_size))
        return cls(rank, size, q, kv, _even(config.intermediate_size, size, rank),
                   _even(config.moe_intermediate_size, size, rank), vocab, block, config.head_dim, heads, kv_heads,
                   config.intermediate_size)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's part: its heads and MLP columns (the vocabulary stays whole:
        sampling sees every token)."""
        return dataclasses.replace(config, num_heads=self.q_heads[1] - self.q_heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   moe_intermediate_size=self.moe_intermediate[1] - self.moe_intermediate[0])

    def pieces(self, name: str) -> list[Piece] | None:
        """The parts of checkpoint tensor `name` this rank reads, concatenated along their dim;
        None: the whole tensor (replicated). An empty list: none of it (row-parallel biases
        live on rank 0 only; the others hold zeros)."""
        d, q, kv = self.head_dim, self.q_heads, self.kv_heads
        q_rows, kv_rows = (q[0] * d, q[1] * d), (kv[0] * d, kv[1] * d)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return [(0, *self.vocab)]
        # Fused tensors first: "qkv_proj.weight" also ends with "v_proj.weight".
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # Phi-3: q|k|v rows in one tensor
            q_total, kv_total = self.num_heads * d, self.num_kv_heads * d
            return [(0, *q_rows), (0, q_total + kv_rows[0], q_total + kv_rows[1]),
                    (0, q_total + kv_total + kv_rows[0], q_total + kv_total + kv_rows[1])]
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return [(0, *q_rows)]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return [(0, *kv_rows)]
        if name.endswith("o_proj.weight"):
            return [(1, *q_rows)]
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            return None if self.rank == 0 else []
        expert = _EXPERT_RE.fullmatch(name)
        if expert is not None:
            inter = self.moe_intermediate
            return [(1, *inter)] if expert.group(1) in ("down_proj", "w2") else [(0, *inter)]
        inter = self.intermediate
        if name.endswith("gate_up_proj.weight"):  # Phi-3: gate|up rows in one tensor ("up_proj.weight" too)
            total = self.intermediate_size
            return [(0, *inter), (0, total + inter[0], total + inter[1])]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return [(0, *inter)]
        if name.endswith("down_proj.weight"):
            return [(1, *inter)]
        return None


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Refuses a tensor-parallel size this model's heads cannot be split by, naming why."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if size < 1:
        raise ValueError("tp_size: must be >= 1")
    if size > 1 and config.vision is not None:
        raise ValueError(f"tp_size: {config.architecture} (a vision-language model) is not supported with tensor "
                         "parallelism yet; run it with tp_size 1")
    if size > heads:
        raise ValueError(f"tp_size: {size} ranks for {heads} attention heads; at most {heads}")
    if size > kv_heads:
        group = heads // kv_heads
        if size % kv_heads or group % (size // kv_heads):
            raise ValueError(f"tp_size: {size} does not split {heads} attention heads with {kv_heads} KV heads "
                             f"(with more ranks than KV heads, tp_size must be a multiple of {kv_heads} that "
                             f"divides the {group} query heads of each KV head among its copies)")
    if config.intermediate_size and config.intermediate_size < size:
        raise ValueError(f"tp_size: {size} is more than the MLP's {config.intermediate_size} columns")
