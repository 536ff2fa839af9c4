"""Rotary position embeddings (the rotate-half layout of Hugging Face Llama checkpoints)."""

from __future__ import annotations

from typing import Any

import torch

from .ops import TORCH_OPS, TorchOps


def _inv_freq(hf_config: Any, dim: int, rope_theta: float, device: torch.device,
              layer_type: str | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the configured rope type.

    transformers' ROPE_INIT_FUNCTIONS implements every scaling scheme (linear, dynamic, yarn,
    llama3, longrope) exactly as the checkpoints expect, so we reuse it instead of re-deriving.
    ModelConfig has already refused the rope types we do not serve. `layer_type` picks a
    per-layer-type entry of rope_parameters (Gemma 3's full/sliding layers).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = (getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
              if hf_config is not None else {})
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    if nested:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        inv = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        return inv.float(), 1.0
    kwargs = {"layer_type": layer_type} if nested else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device, **kwargs)
    return inv.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, hf_config: Any, head_dim: int, rope_theta: float, max_positions: int,
                 device: torch.device | str = "cpu", *, rotary_dim: int = 0, layer_type: str | None = None):
        """rotary_dim: how many leading dims of each head rotate (0: all of them; Phi-3's
        partial_rotary_factor); layer_type: which entry of a per-layer-type rope_parameters."""
        super().__init__()
        self.rotary_dim = rotary_dim if 0 < rotary_dim < head_dim else 0
        dim = self.rotary_dim or head_dim
        inv_freq, scaling = _inv_freq(hf_config, dim, rope_theta, torch.device(device), layer_type)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: TorchOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; rotated in the same dtype (in place with Triton ops)."""
        if not self.rotary_dim:
            return ops.rotary(positions, q, k, self.cos_cache, self.sin_cache)
        # Partial rotary: only the leading dims turn; the torch op works on any strides.
        d = self.rotary_dim
        q_rot, k_rot = TorchOps.rotary(positions, q[..., :d], k[..., :d], self.cos_cache, self.sin_cache)
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)
