"""The decoder every family shares: embedding, layers of attention + (gated MLP or MoE), final
norm, LM head. A family file subclasses CausalLM and sets `family` (family.py) for what differs.

Each residual add is deferred into the next norm (one fused kernel on GPU): a layer returns its
MLP output and the residual stream before that output is added.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...configs import ModelConfig
from ..attention.base import AttentionBackend
from ..parallel import TensorParallel
from . import checkpoint
from .family import Family
from .layers import SINGLE, Attention, Embedding, GatedMLP, Linear, RMSNorm
from .moe import SparseMoE
from .ops import TORCH_OPS, TorchOps
from .rotary import RotaryEmbedding
from .sharding import ShardPlan



def head_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for the LM head. On CPU, MKL runs a vocabulary-wide product about twice as
    fast with the weight as the left operand at a few rows (16 rows of the default model's
    49152 x 576 head: 14-16 ms against 30 as F.linear), the same at one row."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 1:
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, family: Family, ops: TorchOps = TORCH_OPS,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        offset = family.norm_offset

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, ops, offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_id, ops, offset, tp)
        # Llama's post_attention_layernorm is the norm before the MLP; Gemma's normalises the
        # attention output, and pre_/post_feedforward_layernorm wrap the MLP.
        self.post_attention_layernorm = norm()
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        if layer_id in config.sparse_layers:
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act, ops, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ops, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        qkv, residual = self.input_layernorm.forward_into(self.self_attn.qkv_proj, x, residual)
        h = self.self_attn(qkv, positions, rotary, attn)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
            out, residual = self._mlp(self.pre_feedforward_layernorm, h, residual)
            return self.post_feedforward_layernorm(out), residual
        return self._mlp(self.post_attention_layernorm, h, residual)

    def _mlp(self, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(h + residual)), h + residual)."""
        if isinstance(self.mlp, GatedMLP):  # the norm may hand gate_up its input in FP8
            gate_up, residual = norm.forward_into(self.mlp.gate_up_proj, h, residual)
            return self.mlp(gate_up), residual
        h, residual = norm.forward_add(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """The whole model, or under tensor parallelism one rank's part of it (`shard`): its heads
    and MLP columns (so `self.config` is the rank's config) and a block of the vocabulary."""

    family = Family("llama")

    def __init__(self, config: ModelConfig, hf_config: Any = None, ops: TorchOps = TORCH_OPS,
                 shard: ShardPlan | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = config.vocab_size
        self.vocab_start = shard.vocab[0] if shard else 0
        vocab_rows = shard.vocab_block if shard else config.vocab_size
        if shard is not None:
            config = shard.local_config(config)
        self.config = config
        family = self.family
        self.embed_tokens = Embedding(vocab_rows, config.hidden_size)
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype (55.4256 -> 55.5 in bf16).
        self.embed_scale = config.hidden_size ** 0.5 if family.scale_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(config, i, family, ops, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, family.norm_offset)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab_rows, bias=False)
        self.head_linear = head_product  # the LM head's product (batch_invariant.py may replace it)
        self.rotaries, self.rotary_of_layer = self._make_rotaries(config, hf_config)

    def _make_rotaries(self, config: ModelConfig, hf_config: Any) -> tuple[nn.ModuleList, list[int]]:
        """The rotary tables and which one each layer uses (one for all, unless overridden)."""
        rotary = RotaryEmbedding(hf_config, config.head_dim, config.rope_theta, config.context_len,
                                 rotary_dim=config.rotary_dim)
        return nn.ModuleList([rotary]), [0] * config.num_layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """HF tensor names (as `checkpoint_name` gives them) and shapes of a checkpoint."""
        return checkpoint.hf_weight_shapes(config, cls.family)

    @classmethod
    def checkpoint_name(cls, config: ModelConfig, name: str) -> str | None:
        """A checkpoint tensor's name as `checkpoint_shapes` spells it; None for a tensor the
        model knowingly does not use (read nothing, warn nothing)."""
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `logit_rows` of the new tokens (all rows when None): [len(rows), vocab]."""
        return self.forward_embeds(self.embed(input_ids), positions, attn, logit_rows)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                       logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` from the token embeddings on (a vision-language model splices images in first)."""
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()  # a host scalar: no device sync
        residual = None
        for layer, rotary in zip(self.layers, self.rotary_of_layer):
            x, residual = layer(x, residual, positions, self.rotaries[rotary], attn)
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        x, _ = self.norm.forward_add(x, residual)
        logits = self.head_linear(x, self.lm_head_weight).float()
        if self.tp.enabled:  # each rank has a block of the vocabulary; the last block is padded
            logits = self.tp.all_gather_last(logits)[:, :self.vocab_size]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self.embed_tokens(input_ids)
        # Vocabulary parallel: a rank embeds the ids in its block, zeros for the rest; the sum
        # over the ranks is every id's row.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face-named tensors into the fused parameters; every parameter must be set."""
        checkpoint.load_into(self, weights)
