"""Mixtral: Mistral attention with a mixture-of-experts block in every layer. The checkpoint
calls the block `block_sparse_moe` and each expert's gate/down/up projections w1/w2/w3; routing
is softmax over all experts, top-k, renormalised (moe.route)."""

from __future__ import annotations

from .decoder import CausalLM
from .family import Family


class MixtralForCausalLM(CausalLM):
    family = Family("mixtral", mlp_name="block_sparse_moe", expert_names=("w1", "w3", "w2"))


MODELS = {"MixtralForCausalLM": MixtralForCausalLM}
