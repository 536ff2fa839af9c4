"""Frozen configuration records shared by the loader, the model code and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", "llama")
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(model_type, "LlamaForCausalLM")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=_rope_theta(hf_config),
            context_len=getattr(hf_config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(hf_config),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _rope_params(hf_config: Any) -> dict[str, Any]:
    # transformers >= 5 keeps rope settings in `rope_parameters`; older ones in rope_theta/rope_scaling.
    params = getattr(hf_config, "rope_parameters", None)
    return dict(params) if isinstance(params, dict) else {}


def _rope_theta(hf_config: Any) -> float:
    theta = _rope_params(hf_config).get("rope_theta") or getattr(hf_config, "rope_theta", None)
    return float(theta or 10000.0)


def _rope_scaling(hf_config: Any) -> dict[str, Any] | None:
    params = _rope_params(hf_config)
    if params:
        kind = params.get("rope_type", params.get("type", "default"))
        return None if kind == "default" else params
    scaling = getattr(hf_config, "rope_scaling", None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) == "default":
        return None
    return dict(scaling)
