"""Phi-3: the Llama layout, with q|k|v and gate|up already fused in the checkpoint, a sliding
window on every layer when set, optional partial rotary, and LongRoPE (served with its short
factors up to original_max_position_embeddings; ModelConfig caps the context there)."""

from __future__ import annotations

from .decoder import CausalLM
from .family import Family


class Phi3ForCausalLM(CausalLM):
    family = Family("phi3", fused_qkv_checkpoint=True, fused_gate_up_checkpoint=True)


MODELS = {"Phi3ForCausalLM": Phi3ForCausalLM}
