"""Layers every family shares: RMSNorm (plain or Gemma's 1 + w), attention over the paged KV pool,
and the gated MLP. Projections are fused (q|k|v and gate|up) so a layer is a few large matmuls;
checkpoints' separate tensors are copied into row ranges of them when loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...configs import ModelConfig
from ..attention.base import AttentionBackend
from ..parallel import TensorParallel
from .ops import TORCH_OPS, TorchOps
from .rotary import RotaryEmbedding

SINGLE = TensorParallel()


class Linear(nn.Linear):
    """nn.Linear without its random fill: load_weights overwrites every element
    (checkpoint.load_into checks that each is written), and the fill cost 0.8 s of a CPU
    server's start for the 135M default model."""

    def reset_parameters(self) -> None:
        pass


def is_plain_linear(module: nn.Module) -> bool:
    """Whether `module` is a linear projection whose forward is nn.Linear's (a subclass may do
    more in forward, e.g. a collective, which a replacement would drop)."""
    return type(module) in (nn.Linear, Linear)


class Embedding(nn.Embedding):
    """nn.Embedding without its random fill (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps = TORCH_OPS, offset: float = 0.0):
        """offset: 1.0 for Gemma, whose checkpoints store w and scale by (1 + w), computed in fp32
        as transformers does (adding 1 to a bf16 weight first would round it)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops
        self.offset = offset

    def _scale(self) -> torch.Tensor:
        return self.weight if not self.offset else self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # per-head q/k norms: [T, H, D]
            return TorchOps.rms_norm(x, self._scale(), self.eps)
        return self.ops.rms_norm(x, self._scale(), self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the Triton version updates `residual` in place."""
        return self.ops.add_rms_norm(x, residual, self._scale(), self.eps)

    def forward_into(self, linear: nn.Module, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x [+ residual])), the residual stream: x + residual, or x when None).
        An FP8 projection may take the norm over, to have it write e4m3 (Fp8Linear.forward_rms_norm)."""
        fused = getattr(linear, "forward_rms_norm", None)
        out = fused(x, residual, self._scale(), self.eps) if fused is not None else None
        if out is not None:
            return out, x if residual is None else residual
        if residual is None:
            return linear(self(x)), x
        h, residual = self.forward_add(x, residual)
        return linear(h), residual


class Attention(nn.Module):
    """`config` holds this rank's heads (sharding.py); o_proj is row parallel: its partial sums
    are added over the ranks."""

    def __init__(self, config: ModelConfig, layer_id: int, ops: TorchOps = TORCH_OPS, norm_offset: float = 0.0,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=norm_offset) if config.qk_norm else None

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        """The layer from its q|k|v projection on: the caller runs qkv_proj (after its norm,
        RMSNorm.forward_into)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attn.forward_with_rotary(q, k, v, self.layer_id, positions, rotary, self.ops)
        return self.tp.all_reduce(self.o_proj(out))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one projection (gate rows first).
    Under tensor parallelism `intermediate_size` is this rank's columns; down is row parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, ops: TorchOps = TORCH_OPS,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.hidden_act = hidden_act
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP from its gate|up projection on: the caller runs gate_up_proj (after its norm,
        RMSNorm.forward_into). An FP8 down_proj may take SiLU-and-mul over, to have it write
        e4m3 (Fp8Linear.forward_silu_and_mul)."""
        fused = getattr(self.down_proj, "forward_silu_and_mul", None) if self.hidden_act == "silu" else None
        out = fused(gate_up) if fused is not None else None
        if out is None:
            out = self.down_proj(act_and_mul(gate_up, self.hidden_act, self.ops))
        return self.tp.all_reduce(out)


def act_and_mul(gate_up: torch.Tensor, hidden_act: str, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
    """act(gate) * up for [..., 2 * I] rows holding gate then up."""
    if hidden_act == "silu":
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up  # gelu_pytorch_tanh (ModelConfig refuses others)
