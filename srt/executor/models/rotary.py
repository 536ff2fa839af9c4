"""Rotary position embeddings (the rotate-half layout of Hugging Face Llama checkpoints)."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.srt.executor.models.ops import TorchOps


def _inv_freq(hf_config: Any, head_dim: int, rope_theta: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the configured rope type.

    transformers' ROPE_INIT_FUNCTIONS implements every scaling scheme (linear, dynamic, yarn,
    llama3, longrope) exactly as the checkpoints expect, so we reuse it instead of re-deriving.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if hf_config is not None else "default"
    if rope_type == "default" or hf_config is None:
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        return inv.float(), 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
    return inv.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, hf_config: Any, head_dim: int, rope_theta: float, max_positions: int,
                 device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq, scaling = _inv_freq(hf_config, head_dim, rope_theta, torch.device(device))
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: type[TorchOps] = TorchOps) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; rotated in the same dtype (in place with Triton ops)."""
        return ops.rotary(positions, q, k, self.cos_cache, self.sin_cache)
