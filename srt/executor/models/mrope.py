"""M-RoPE (Qwen2.5-VL): rotary over three position rows (temporal, height, width).

`mrope_section` splits a head's rotary pairs among the rows: pair j turns by row i's position
when j falls in section i. The positions themselves come from srt/core/image_positions.py.
Where the three rows agree (text, and so every decode step) this is plain rope at that
position, and the same tables, kernels and CUDA graphs serve it; only a prefill over an
image's tokens, whose rows differ, gathers per dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .ops import TORCH_OPS, TorchOps
from .rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, hf_config: Any, head_dim: int, rope_theta: float, max_positions: int,
                 mrope_section: Sequence[int], device: torch.device | str = "cpu"):
        super().__init__(hf_config, head_dim, rope_theta, max_positions, device)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {tuple(mrope_section)}: three sections summing to head_dim / 2")
        row_of_pair = torch.repeat_interleave(torch.arange(3), torch.tensor(tuple(mrope_section)))
        # Rotate-half layout: dims j and j + D/2 form pair j.
        self.register_buffer("row_of_dim", torch.cat((row_of_pair, row_of_pair)).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: TorchOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (the rows agree) or [3, T]; q: [T, H, D], k: [T, Hkv, D]."""
        if positions.dim() == 1:
            return super().forward(positions, q, k, ops)
        per_dim = positions[self.row_of_dim].T  # [T, D]: each dimension's own row
        dims = torch.arange(per_dim.shape[1], device=positions.device)
        cos = self.cos_cache[per_dim, dims].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[per_dim, dims].unsqueeze(1).to(q.dtype)
        # In q's dtype, as TorchOps.rotary and transformers compute it.
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
