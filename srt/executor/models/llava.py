"""LLaVA (1.5 style): a CLIP vision tower, a two-layer GELU projector, and our decoder as the
language model (Llama or Qwen2: their differences are ModelConfig options).

An image's placeholder positions carry pseudo token ids >= vocab_size (srt/multimodal/hashing.py:
the radix cache keys them by the image's content); they embed as row 0 and are then overwritten
with the image's projected features, which the model runner computes beforehand through the
encoder cache (srt/executor/image_embeds.py). Decode steps never see images.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...configs import LLAVA, ModelConfig, VisionConfig
from ...io_struct import ImageInput
from ..attention.base import AttentionBackend
from ..parallel import TensorParallel
from .clip import ClipVisionTower
from .decoder import CausalLM
from .family import Family
from .layers import SINGLE, Linear
from .ops import TORCH_OPS, TorchOps
from .sharding import ShardPlan

# The layouts LLaVA checkpoints come in, to ours: llava-hf's (language_model.model.*,
# vision_tower.vision_model.*), and transformers >= 4.52's (model.language_model.*, ...).
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))
_TOWER_LAYER_RE = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.")


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, bias: bool):
        super().__init__()
        self.linear_1 = Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaForConditionalGeneration(CausalLM):
    family = Family("llama")

    def __init__(self, config: ModelConfig, hf_config: Any = None, ops: TorchOps = TORCH_OPS,
                 shard: ShardPlan | None = None, tp: TensorParallel = SINGLE):
        # The decoder reads its rope settings from the language model's own config.
        super().__init__(config, getattr(hf_config, "text_config", None), ops, shard, tp)
        vision = config.vision
        self.vision_tower = ClipVisionTower(vision)
        self.multi_modal_projector = Projector(vision.hidden_size, config.hidden_size, vision.projector_bias)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {**super().checkpoint_shapes(config), **_tower_shapes(config.vision, config.hidden_size)}

    @classmethod
    def checkpoint_name(cls, config: ModelConfig, name: str) -> str | None:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        if name.startswith(("vision_tower.post_layernorm.", "vision_tower.embeddings.position_ids")):
            return None  # LLaVA reads a hidden state: the pooled output's norm is never used
        layer = _TOWER_LAYER_RE.match(name)
        if layer is not None and int(layer.group(1)) >= config.vision.num_layers:
            return None  # past the feature layer
        return name

    @staticmethod
    def image_batch_key(image: ImageInput) -> Hashable:
        """Same-size images stack into one tower forward."""
        return tuple(image.shape)

    def encode_images(self, pixels: Sequence[torch.Tensor], images: Sequence[ImageInput]) -> torch.Tensor:
        """Projected features of same-size images ([C, H, W] each): [B, tokens_per_image, hidden]."""
        features = self.vision_tower(torch.stack(list(pixels)).to(self.multi_modal_projector.linear_1.weight.dtype))
        if not self.config.vision.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Image placeholders (pseudo ids >= vocab_size) embed as row 0 until their features replace them.
        return super().embed(torch.where(input_ids < self.vocab_size, input_ids, 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_rows: torch.Tensor | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """image_embeds: (rows of this batch's tokens, their features [rows, hidden])."""
        x = self.embed(input_ids)
        if image_embeds is not None:
            rows, features = image_embeds
            x = x.index_copy(0, rows, features.to(x.dtype))
        return self.forward_embeds(x, positions, attn, logit_rows)


def _tower_shapes(vision: VisionConfig, text_hidden: int) -> dict[str, tuple[int, ...]]:
    hidden, inter = vision.hidden_size, vision.intermediate_size
    positions = (vision.image_size // vision.patch_size) ** 2 + 1
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.embeddings.class_embedding": (hidden,),
        "vision_tower.embeddings.patch_embedding.weight": (hidden, vision.num_channels, vision.patch_size,
                                                           vision.patch_size),
        "vision_tower.embeddings.position_embedding.weight": (positions, hidden),
        "vision_tower.pre_layrnorm.weight": (hidden,), "vision_tower.pre_layrnorm.bias": (hidden,),
    }
    for i in range(vision.num_layers):
        prefix = f"vision_tower.encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes.update({f"{prefix}{norm}.weight": (hidden,), f"{prefix}{norm}.bias": (hidden,)})
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes.update({f"{prefix}self_attn.{proj}.weight": (hidden, hidden),
                           f"{prefix}self_attn.{proj}.bias": (hidden,)})
        shapes.update({f"{prefix}mlp.fc1.weight": (inter, hidden), f"{prefix}mlp.fc1.bias": (inter,),
                       f"{prefix}mlp.fc2.weight": (hidden, inter), f"{prefix}mlp.fc2.bias": (hidden,)})
    shapes.update({"multi_modal_projector.linear_1.weight": (text_hidden, hidden),
                   "multi_modal_projector.linear_2.weight": (text_hidden, text_hidden)})
    if vision.projector_bias:
        shapes.update({"multi_modal_projector.linear_1.bias": (text_hidden,),
                       "multi_modal_projector.linear_2.bias": (text_hidden,)})
    return shapes


MODELS = {LLAVA: LlavaForConditionalGeneration}
