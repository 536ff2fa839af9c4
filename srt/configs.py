"""Frozen configuration records shared by the loader, the model code and the runner.

`ModelConfig.from_hf` reads a Hugging Face config into one record for every supported family.
What a family adds on top of the Llama shape is read by that family's reader below, and every
option we do not implement is refused by name here, before any weight is read: a model that
loads must compute what Hugging Face transformers computes. (No torch import: the config is
read in processes that never run the model.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from .qwen2_5_vl_config import QWEN2_5_VL, Qwen2_5_VLVision, read_qwen2_5_vl_vision

# Rope types whose frequencies are fixed for the whole context we serve. "dynamic" (NTK)
# changes them only past max_position_embeddings, which is our context length; "longrope"
# switches to its long factors past original_max_position_embeddings, so the context is
# capped there (see _context_len).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LLAVA = "LlavaForConditionalGeneration"
# LLaVA's language models: families whose differences are all ModelConfig options.
LLAVA_TEXT_MODELS = ("llama", "qwen2")
CLIP_ACTIVATIONS = ("quick_gelu", "gelu")


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style vision tower (CLIP) and its projector into the language model."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int  # layers run: those up to vision_feature_layer (the rest are never read)
    image_size: int  # square input the processor makes (CLIP's positions are not interpolated)
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # quick_gelu (OpenAI CLIP) or gelu
    keep_cls: bool  # vision_feature_select_strategy "full"; "default" drops the CLS token
    image_token_id: int  # the placeholder a prompt writes once per image
    projector_bias: bool = True
    num_channels: int = 3

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (1 if self.keep_cls else 0)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens an image stands for in a prompt's text."""
        return (self.image_token_id,)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config."""

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
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama-style attention_bias)
    o_proj_bias: bool = False  # bias on o_proj too (Llama/Qwen3 attention_bias; never Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Qwen3-MoE, Gemma 3)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh (Gemma)
    rotary_dim: int = 0  # leading dims of each head that rotate (0: all; Phi-3 partial_rotary_factor)
    # Per layer: attend to the last `w` positions (the query's own included, HF's convention),
    # or None for full causal attention. Empty means full attention everywhere.
    sliding_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: rope base of the sliding-window layers
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0 for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block
    # A vision-language model's tower (LLaVA's CLIP, or Qwen2.5-VL's); None: text only.
    vision: VisionConfig | Qwen2_5_VLVision | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer_id: int) -> int | None:
        return self.sliding_windows[layer_id] if self.sliding_windows else None

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", "llama")
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(model_type, "LlamaForCausalLM")
        if arch == LLAVA:
            return _llava(hf_config)
        if arch == QWEN2_5_VL:
            return _qwen2_5_vl(hf_config)
        if arch not in _FAMILY_READERS:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope = _rope_params(hf_config, FULL_ATTENTION)
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0),
            context_len=_context_len(hf_config, rope),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_proj_bias=bool(getattr(hf_config, "attention_bias", False)),
            rope_scaling=_rope_scaling(rope),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
        _refuse_unknown(hf_config, arch)
        fields.update(_FAMILY_READERS[arch](hf_config))
        return cls(**fields)


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llava": LLAVA,
    "qwen2_5_vl": QWEN2_5_VL,
    "qwen2_5_vl_text": "Qwen2ForCausalLM",  # Qwen2.5-VL's language model: a Qwen2 decoder with M-RoPE
}


# ---- vision-language models ------------------------------------------------------------------


def _llava(hf_config: Any) -> ModelConfig:
    """LLaVA (1.5 style): a CLIP tower, a 2-layer projector and a Llama or Qwen2 language model,
    read as that language model's config plus the tower. Every LLaVA option we do not compute
    is refused by name: several feature layers, anyres tiling, other towers and projectors."""
    text = hf_config.text_config
    if text.model_type not in LLAVA_TEXT_MODELS:
        raise ValueError(f"{LLAVA} with a {text.model_type!r} language model is not supported "
                         f"(supported: {', '.join(LLAVA_TEXT_MODELS)})")
    vision = hf_config.vision_config
    if vision.model_type != "clip_vision_model":
        raise ValueError(f"{LLAVA} with a {vision.model_type!r} vision tower is not supported (only "
                         "clip_vision_model)")
    layer = hf_config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: several feature layers are not supported (one layer is)")
    if not -vision.num_hidden_layers - 1 <= layer <= vision.num_hidden_layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {vision.num_hidden_layers} layers")
    strategy = hf_config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full are)")
    if getattr(hf_config, "image_grid_pinpoints", None):
        raise ValueError("image_grid_pinpoints (LLaVA-NeXT anyres tiling) is not supported")
    if hf_config.projector_hidden_act != "gelu":
        raise ValueError(f"projector_hidden_act {hf_config.projector_hidden_act!r} is not supported (only gelu)")
    if vision.hidden_act not in CLIP_ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {vision.hidden_act!r} is not supported "
                         f"({', '.join(CLIP_ACTIVATIONS)} are)")
    if vision.hidden_size % vision.num_attention_heads:
        raise ValueError("vision_config.hidden_size must be a multiple of num_attention_heads")
    tower = VisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
        num_heads=vision.num_attention_heads,
        # hidden_states[0] is the embedding, [i] the output of layer i; negative counts from the end.
        num_layers=layer if layer >= 0 else vision.num_hidden_layers + 1 + layer,
        image_size=vision.image_size, patch_size=vision.patch_size, layer_norm_eps=vision.layer_norm_eps,
        hidden_act=vision.hidden_act, keep_cls=strategy == "full", image_token_id=hf_config.image_token_index,
        projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
        num_channels=vision.num_channels)
    language = ModelConfig.from_hf(text)
    if not 0 <= tower.image_token_id < language.vocab_size:
        raise ValueError(f"image_token_index {tower.image_token_id} is outside the vocabulary [0, {language.vocab_size})")
    # The top-level flag wins: transformers copies a text config's tie_word_embeddings up to it.
    return dataclasses.replace(language, architecture=LLAVA, vision=tower,
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


def _qwen2_5_vl(hf_config: Any) -> ModelConfig:
    """Qwen2.5-VL: its windowed vision tower and merger (qwen2_5_vl_config.py), and a Qwen2
    language model whose rotary takes three position rows (M-RoPE) with rope_theta only."""
    language = ModelConfig.from_hf(hf_config.text_config)
    if language.rope_scaling is not None:
        raise ValueError(f"{QWEN2_5_VL} with rope type {language.rope_scaling.get('rope_type')!r} is not supported "
                         "(M-RoPE with the default rope is)")
    vision = read_qwen2_5_vl_vision(hf_config, language.head_dim, language.vocab_size)
    return dataclasses.replace(language, architecture=QWEN2_5_VL, vision=vision,
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))


# ---- what each family adds ---------------------------------------------------------------------


def _llama(hf_config: Any) -> dict[str, Any]:
    return {}


def _mistral(hf_config: Any) -> dict[str, Any]:
    # Mistral, Mixtral and Phi-3 window every layer when `sliding_window` is set.
    return {"sliding_windows": _all_layers_window(hf_config)}


def _qwen2(hf_config: Any) -> dict[str, Any]:
    # Qwen2 biases q/k/v but not o_proj. With use_sliding_window, layers from
    # max_window_layers on are windowed; transformers spells that out in layer_types.
    return {"attention_bias": True, "o_proj_bias": False, "sliding_windows": _layer_type_windows(hf_config)}


def _qwen3(hf_config: Any) -> dict[str, Any]:
    return {"qk_norm": True, "sliding_windows": _layer_type_windows(hf_config)}


def _gemma(hf_config: Any) -> dict[str, Any]:
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported")
    return {"hidden_act": act, "sliding_windows": _layer_type_windows(hf_config),
            "query_pre_attn_scalar": float(hf_config.query_pre_attn_scalar),
            "final_logit_softcap": _softcap(hf_config, "final_logit_softcapping")}


def _gemma2(hf_config: Any) -> dict[str, Any]:
    return {**_gemma(hf_config), "attn_logit_softcap": _softcap(hf_config, "attn_logit_softcapping")}


def _gemma3(hf_config: Any) -> dict[str, Any]:
    # transformers' Gemma 3 never applies attn_logit_softcapping; a checkpoint that sets it
    # expects something we cannot check against the reference, so it is refused.
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
    local = _rope_params(hf_config, SLIDING_ATTENTION)
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {local['rope_type']!r} on sliding-window layers is not supported")
    return {**_gemma(hf_config), "qk_norm": True, "local_rope_theta": float(local["rope_theta"])}


def _phi3(hf_config: Any) -> dict[str, Any]:
    factor = float(_rope_params(hf_config, FULL_ATTENTION).get("partial_rotary_factor", 1.0))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return {**_mistral(hf_config), "rotary_dim": int(head_dim * factor) if factor != 1.0 else 0}


def _mixtral(hf_config: Any) -> dict[str, Any]:
    # Softmax over all experts, top-k, then the k weights renormalised (always, in Mixtral).
    return {**_mistral(hf_config), "num_experts": hf_config.num_local_experts,
            "num_experts_per_tok": hf_config.num_experts_per_tok,
            "moe_intermediate_size": hf_config.intermediate_size, "norm_topk_prob": True,
            "sparse_layers": tuple(range(hf_config.num_hidden_layers))}


def _qwen3_moe(hf_config: Any) -> dict[str, Any]:
    # Softmax over all experts, top-k, renormalised only with norm_topk_prob. Layers listed in
    # mlp_only_layers, or off the decoder_sparse_step grid, keep a dense MLP.
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    sparse = tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return {"qk_norm": True, "sliding_windows": _all_layers_window(hf_config),
            "num_experts": hf_config.num_experts, "num_experts_per_tok": hf_config.num_experts_per_tok,
            "moe_intermediate_size": hf_config.moe_intermediate_size,
            "norm_topk_prob": bool(hf_config.norm_topk_prob), "sparse_layers": sparse}


_FAMILY_READERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
}
SUPPORTED_ARCHITECTURES = (*_FAMILY_READERS, LLAVA, QWEN2_5_VL)


# ---- shared readers --------------------------------------------------------------------------


def _all_layers_window(hf_config: Any) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    return (int(window),) * hf_config.num_hidden_layers if window else ()


def _layer_type_windows(hf_config: Any) -> tuple[int | None, ...]:
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        return ()
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (only {FULL_ATTENTION}, {SLIDING_ATTENTION})")
    window = getattr(hf_config, "sliding_window", None)
    if SLIDING_ATTENTION in layer_types and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    windows = tuple(int(window) if kind == SLIDING_ATTENTION else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


def _softcap(hf_config: Any, name: str) -> float | None:
    value = getattr(hf_config, name, None)
    return float(value) if value else None


def _rope_params(hf_config: Any, layer_type: str) -> dict[str, Any]:
    # transformers >= 5 keeps rope settings in `rope_parameters` (per layer type for Gemma 3);
    # older ones in rope_theta/rope_scaling.
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict):
        if layer_type in params and isinstance(params[layer_type], dict):
            return dict(params[layer_type])
        return dict(params)
    scaling = getattr(hf_config, "rope_scaling", None)
    return dict(scaling) if isinstance(scaling, dict) else {}


def _rope_type(params: dict[str, Any]) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return kind


def _rope_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    return None if _rope_type(params) == "default" else params


def _context_len(hf_config: Any, rope: dict[str, Any]) -> int:
    context = getattr(hf_config, "max_position_embeddings", 2048)
    if _rope_type(rope) == "longrope":
        # transformers switches every position to the long factors once a sequence passes
        # original_max_position_embeddings, re-rotating keys that are already cached: the
        # short factors up to there are exact, so that is the context we serve.
        original = rope.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if original:
            context = min(context, int(original))
    return context


def _refuse_unknown(hf_config: Any, arch: str) -> None:
    """Options of these families that change the computation and that we do not implement."""
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if not arch.startswith("Gemma") and act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only silu)")
    if arch.startswith("Gemma"):
        gemma_act = getattr(hf_config, "hidden_activation", None) or act
        if gemma_act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {gemma_act!r} is not supported for {arch} (only gelu_pytorch_tanh)")
    if getattr(hf_config, "attention_chunk_size", None):
        raise ValueError("attention_chunk_size (chunked attention) is not supported")
