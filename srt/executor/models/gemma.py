"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), norms before
and after both attention and MLP, GeLU (tanh) MLP, attention scaled by query_pre_attn_scalar,
alternating sliding-window and full layers (layer_types). Gemma 2 soft-caps attention scores
and final logits; Gemma 3 instead normalises q and k per head and gives its sliding-window
layers their own rope base (local_rope_theta) while full layers may scale theirs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...configs import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from .decoder import CausalLM
from .family import Family
from .rotary import RotaryEmbedding


class Gemma2ForCausalLM(CausalLM):
    family = Family("gemma2", norm_offset=1.0, sandwich_norms=True, scale_embeddings=True)


class Gemma3ForCausalLM(CausalLM):
    family = Family("gemma3", norm_offset=1.0, sandwich_norms=True, scale_embeddings=True, local_rope=True)

    def _make_rotaries(self, config: ModelConfig, hf_config: Any) -> tuple[nn.ModuleList, list[int]]:
        full = RotaryEmbedding(hf_config, config.head_dim, config.rope_theta, config.context_len,
                               layer_type=FULL_ATTENTION)
        local = RotaryEmbedding(hf_config, config.head_dim, config.local_rope_theta, config.context_len,
                                layer_type=SLIDING_ATTENTION)
        return nn.ModuleList([full, local]), [0 if config.window_of(i) is None else 1 for i in range(config.num_layers)]


MODELS = {"Gemma2ForCausalLM": Gemma2ForCausalLM, "Gemma3ForCausalLM": Gemma3ForCausalLM}
