"""Qwen2.5-VL: the windowed vision tower with its patch merger (qwen2_5_vl_vision.py), and our
decoder as the Qwen2 language model, its rotary turned by three position rows (M-RoPE, mrope.py).

As with LLaVA, an image's tokens carry pseudo ids >= vocab_size that embed as row 0 and are
overwritten with the image's merged features, computed beforehand through the encoder cache
(srt/executor/image_embeds.py). The batch builder gives image tokens their (t, h, w) rows and
every other token one row shifted by the request's images (srt/core/image_positions.py), so
decode steps and their CUDA graphs are those of a text model.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...configs import ModelConfig
from ...io_struct import ImageInput
from ...qwen2_5_vl_config import QWEN2_5_VL, Qwen2_5_VisionConfig
from ..attention.base import AttentionBackend
from ..parallel import TensorParallel
from .decoder import CausalLM
from .family import Family
from .layers import SINGLE
from .mrope import MRotaryEmbedding
from .ops import TORCH_OPS, TorchOps
from .qwen2_5_vl_vision import Qwen2_5_VisionEncoder
from .sharding import ShardPlan

# transformers >= 5 saves model.language_model.* and model.visual.*; Qwen's own checkpoints
# have model.* and visual.*.
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))
PATCH_CONV = "visual.patch_embed.proj.weight"  # a Conv3d with stride == kernel: a linear map per patch
PATCH_LINEAR = "visual.patch_embed.weight"


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    family = Family("llama")  # Qwen2's differences (q/k/v bias, windows) are ModelConfig options

    def __init__(self, config: ModelConfig, hf_config: Any = None, ops: TorchOps = TORCH_OPS,
                 shard: ShardPlan | None = None, tp: TensorParallel = SINGLE):
        # The decoder reads its rope settings from the language model's own config.
        super().__init__(config, getattr(hf_config, "text_config", None), ops, shard, tp)
        self.visual = Qwen2_5_VisionEncoder(config.vision.tower)

    def _make_rotaries(self, config: ModelConfig, hf_config: Any) -> tuple[nn.ModuleList, list[int]]:
        rotary = MRotaryEmbedding(hf_config, config.head_dim, config.rope_theta, config.context_len,
                                  config.vision.mrope_section)
        return nn.ModuleList([rotary]), [0] * config.num_layers

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {**super().checkpoint_shapes(config), **_tower_shapes(config.vision.tower)}

    @classmethod
    def checkpoint_name(cls, config: ModelConfig, name: str) -> str | None:
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().load_weights(_PatchAsLinear(weights))

    @staticmethod
    def image_batch_key(image: ImageInput) -> Hashable:
        """Images of any size run in one tower forward (each is its own attention segments)."""
        return None

    def encode_images(self, pixels: Sequence[torch.Tensor], images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's merged features [its tokens, hidden], row-major over its token grid.
        pixels: [patches, patch_dim] per image, as Qwen2VLImageProcessor made them."""
        merge = self.config.vision.tower.spatial_merge_size
        grids = torch.tensor([(1, rows * merge, cols * merge) for rows, cols in (i.token_grid for i in images)])
        features = self.visual(torch.cat(list(pixels)), grids)
        # Copies, so that each cached image holds its own memory, not the whole batch's.
        return [one.clone() for one in features.split([image.length for image in images])]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Image placeholders (pseudo ids >= vocab_size) embed as row 0 until their features replace them.
        return super().embed(torch.where(input_ids < self.vocab_size, input_ids, 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_rows: torch.Tensor | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """positions: [T], or [3, T] where the batch feeds image tokens; image_embeds: (rows of
        this batch's tokens, their features [rows, hidden])."""
        x = self.embed(input_ids)
        if image_embeds is not None:
            rows, features = image_embeds
            x = x.index_copy(0, rows, features.to(x.dtype))
        return self.forward_embeds(x, positions, attn, logit_rows)


class _PatchAsLinear(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors with the patch Conv3d [hidden, C, T, P, P] read as the Linear
    [hidden, C*T*P*P] the encoder holds; read one at a time (dummy weights are made when read)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self._weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == PATCH_LINEAR:
            conv = self._weights[PATCH_CONV]
            return conv.reshape(conv.shape[0], -1)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return (PATCH_LINEAR if name == PATCH_CONV else name for name in self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _tower_shapes(tower: Qwen2_5_VisionConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = tower.hidden_size, tower.intermediate_size
    merged = hidden * tower.spatial_merge_size ** 2
    shapes: dict[str, tuple[int, ...]] = {
        PATCH_CONV: (hidden, tower.in_channels, tower.temporal_patch_size, tower.patch_size, tower.patch_size)}
    for i in range(tower.depth):
        prefix = f"visual.blocks.{i}."
        shapes.update({f"{prefix}norm1.weight": (hidden,), f"{prefix}norm2.weight": (hidden,),
                       f"{prefix}attn.qkv.weight": (3 * hidden, hidden), f"{prefix}attn.qkv.bias": (3 * hidden,),
                       f"{prefix}attn.proj.weight": (hidden, hidden), f"{prefix}attn.proj.bias": (hidden,)})
        for proj in ("gate_proj", "up_proj"):
            shapes.update({f"{prefix}mlp.{proj}.weight": (inter, hidden), f"{prefix}mlp.{proj}.bias": (inter,)})
        shapes.update({f"{prefix}mlp.down_proj.weight": (hidden, inter), f"{prefix}mlp.down_proj.bias": (hidden,)})
    shapes.update({"visual.merger.ln_q.weight": (hidden,),
                   "visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
                   "visual.merger.mlp.2.weight": (tower.out_hidden_size, merged),
                   "visual.merger.mlp.2.bias": (tower.out_hidden_size,)})
    return shapes


MODELS = {QWEN2_5_VL: Qwen2_5_VLForConditionalGeneration}
