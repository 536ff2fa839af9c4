"""Llama family: Llama 2/3.x, SmolLM2, Mistral (sliding window on every layer when set), Qwen2
(q/k/v bias, windows from max_window_layers when use_sliding_window), Qwen3 (q/k RMSNorm).

They share the plain decoder; their differences are all config options (ModelConfig).
"""

from __future__ import annotations

from .decoder import CausalLM
from .family import Family


class LlamaForCausalLM(CausalLM):
    family = Family("llama")


MODELS = dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
                       LlamaForCausalLM)
