"""The model registry: Hugging Face `architectures` name -> our model class, one family file each.

ModelConfig.from_hf refuses any architecture it cannot read; this table must name a class for
each one it reads (tests/test_model_families.py checks that the two agree).
"""

from __future__ import annotations

from ...configs import ModelConfig
from . import gemma, llama, llava, mixtral, phi3, qwen2_5_vl, qwen3_moe
from .decoder import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    **llama.MODELS, **gemma.MODELS, **phi3.MODELS, **mixtral.MODELS, **qwen3_moe.MODELS,
    **llava.MODELS, **qwen2_5_vl.MODELS,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"architecture {config.architecture!r} has no model class; "
                         f"registered: {sorted(MODEL_CLASSES)}") from None
