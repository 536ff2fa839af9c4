"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral, Qwen2 qkv bias, Qwen3 q/k norm).

Projections are fused (q|k|v and gate|up) so a layer is a few large matmuls; attention runs
through an AttentionBackend over the paged KV pool.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.srt.executor.attention.base import AttentionBackend
from radixlm.srt.configs import ModelConfig
from radixlm.srt.executor.models.ops import TorchOps
from radixlm.srt.executor.models.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: type[TorchOps] = TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # per-head q/k norms: [T, H, D]
            return TorchOps.rms_norm(x, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the Triton version updates `residual` in place."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, ops: type[TorchOps] = TorchOps):
        super().__init__()
        self.ops = ops
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Llama and Qwen3 put a bias on o_proj with attention_bias; Qwen2 biases only q/k/v.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k, self.ops)
        return self.o_proj(attn.forward(q, k, v, self.layer_id))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: type[TorchOps] = TorchOps):
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, ops: type[TorchOps] = TorchOps):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, layer_id, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added).

        Deferring each residual add into the next norm lets both run as one fused kernel.
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h = self.self_attn(h, positions, rotary, attn)
        h, residual = self.post_attention_layernorm.forward_add(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, hf_config: Any = None, ops: type[TorchOps] = TorchOps):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(hf_config, config.head_dim, config.rope_theta, config.context_len)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `logit_rows` of the new tokens (all rows when None): [len(rows), vocab]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        x, _ = self.norm.forward_add(x, residual)
        return F.linear(x, self.lm_head_weight).float()

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face-named tensors into the fused parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
            target = params[name] if rows is None else params[name][rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name}{'' if rows is None else rows}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)

        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", slice(0, q)),
            "k_proj": ("qkv_proj", slice(q, q + kv)),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "gate_proj": ("gate_up_proj", slice(0, cfg.intermediate_size)),
            "up_proj": ("gate_up_proj", slice(cfg.intermediate_size, 2 * cfg.intermediate_size)),
        }
        for hf_name, tensor in weights.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            parts = name.split(".")
            if len(parts) >= 4 and parts[-2] in fused:
                target, rows = fused[parts[-2]]
                put(".".join(parts[:-2] + [target, parts[-1]]), tensor, rows)
            elif name in params:
                put(name, tensor)
            else:
                raise ValueError(f"unexpected weight {hf_name!r}")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"missing weights: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
