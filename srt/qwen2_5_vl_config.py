"""Qwen2.5-VL's config, read without torch: the vision tower's shape and the image tokens, for
ModelConfig.vision. Every option we do not compute is refused here by name, before any weight
is read (configs.py reads the language model as Qwen2 and joins the two)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class Qwen2_5_VisionConfig:
    """The `visual.*` tower: patch embedding, windowed / full-attention blocks, patch merger."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, hf: Any) -> Qwen2_5_VisionConfig:
        """From a Qwen2_5_VLVisionConfig (or the vision_config dict of a checkpoint's config.json);
        refuses, by name, the options this encoder does not implement."""
        get = hf.get if isinstance(hf, dict) else (lambda key, default=None: getattr(hf, key, default))
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
        rope = get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type={rope.get('rope_type')!r} is not supported")
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(get(key, 1), int):
                raise ValueError(f"vision_config.{key}={get(key)!r}: only a single int is supported")
        config = cls(depth=get("depth"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
                     num_heads=get("num_heads"), in_channels=get("in_channels", get("in_chans", 3)),
                     patch_size=get("patch_size", 14),
                     temporal_patch_size=get("temporal_patch_size", 2),
                     spatial_merge_size=get("spatial_merge_size", 2), window_size=get("window_size", 112),
                     out_hidden_size=get("out_hidden_size"),
                     fullatt_block_indexes=tuple(get("fullatt_block_indexes", ())),
                     rope_theta=float(rope.get("rope_theta", 10000.0)))
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(f"vision_config: head_dim {config.hidden_size}/{config.num_heads} must be a multiple of 4")
        if config.window_size < config.patch_size * config.spatial_merge_size:
            raise ValueError(f"vision_config.window_size={config.window_size} is smaller than one merged patch")
        return config


@dataclass(frozen=True)
class Qwen2_5_VLVision:
    """ModelConfig.vision of Qwen2.5-VL. A prompt writes <|vision_start|><|image_pad|><|vision_end|>
    per image; the pad becomes (h / merge) * (w / merge) tokens of the image's patch grid."""

    tower: Qwen2_5_VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int | None
    mrope_section: tuple[int, ...]  # rotary pairs per position row (temporal, height, width)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens an image stands for in a prompt's text (the chat template's spelling)."""
        return self.vision_start_token_id, self.image_token_id, self.vision_end_token_id


def read_qwen2_5_vl_vision(hf_config: Any, head_dim: int, vocab_size: int) -> Qwen2_5_VLVision:
    """The vision part of a Qwen2_5_VLConfig, checked against the language model's head_dim and
    vocabulary."""
    tower = Qwen2_5_VisionConfig.from_hf(hf_config.vision_config)
    text = hf_config.text_config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    section = tuple(int(s) for s in rope.get("mrope_section", (16, 24, 24)))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"text_config.rope_parameters.mrope_section {section}: three sections summing to "
                         f"head_dim / 2 = {head_dim // 2} are supported")
    if tower.out_hidden_size != text.hidden_size:
        raise ValueError(f"vision_config.out_hidden_size {tower.out_hidden_size} differs from the language model's "
                         f"hidden_size {text.hidden_size}")
    ids = {name: getattr(hf_config, name, None)
           for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    for name, value in ids.items():
        if not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(f"{name} {value!r} is not a token of the vocabulary [0, {vocab_size})")
    video = getattr(hf_config, "video_token_id", None)
    return Qwen2_5_VLVision(tower=tower, mrope_section=section, video_token_id=video, **ids)
