"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm) with a mixture-of-experts block in the layers that
ModelConfig.sparse_layers lists (mlp_only_layers and decoder_sparse_step keep others dense);
routing is softmax over all experts, top-k, renormalised only with norm_topk_prob."""

from __future__ import annotations

from .decoder import CausalLM
from .family import Family


class Qwen3MoeForCausalLM(CausalLM):
    family = Family("qwen3_moe")


MODELS = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
