"""The family's Hugging Face image processor, from the checkpoint's preprocessor_config.json
when it has one, else the family's defaults at the tower's sizes:

- LLaVA: CLIP's (resize the shortest edge, center crop, rescale, normalize): pixel values
  [C, H, W] and a fixed number of tokens per image;
- Qwen2.5-VL: Qwen2VLImageProcessor's (resize to multiples of patch * merge within its pixel
  bounds, rescale, normalize, cut into patches): [patches, C*T*P*P] and a grid of
  (h / merge) x (w / merge) tokens that depends on the image's size.

We always run the Pil variants (what transformers >= 5 gives without torchvision), so pixels do
not depend on whether torchvision is installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..configs import VisionConfig
from ..qwen2_5_vl_config import Qwen2_5_VLVision

CLIP_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
QWEN_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32, in the layout the tower reads
    tokens: int  # placeholder tokens the image expands into
    token_grid: tuple[int, int] | None = None  # (rows, cols) of those tokens, for M-RoPE; None: a plain run


class ImageProcessor:
    """Decoded RGB image -> what the tower reads. `settings` is part of every image's hash: the
    same pixels processed otherwise are another input."""

    def __init__(self, hf_processor: Any):
        self.hf = hf_processor
        self.settings = json.dumps(hf_processor.to_dict(), sort_keys=True, default=str)

    def __call__(self, image: Any) -> ProcessedImage:
        raise NotImplementedError


class ClipImageProcessor(ImageProcessor):
    def __init__(self, hf_processor: Any, vision: VisionConfig):
        super().__init__(hf_processor)
        crop = hf_processor.crop_size if hf_processor.do_center_crop else None
        if crop is None or (crop["height"], crop["width"]) != (vision.image_size, vision.image_size):
            raise ValueError(f"preprocessor_config.json: images must be center-cropped to the vision tower's "
                             f"{vision.image_size}x{vision.image_size} (crop_size is {crop})")
        self.tokens = vision.tokens_per_image

    def __call__(self, image: Any) -> ProcessedImage:
        pixels = self.hf(images=[image], return_tensors="np")["pixel_values"][0]
        return ProcessedImage(pixels.astype(np.float32, copy=False), self.tokens)


class QwenImageProcessor(ImageProcessor):
    def __init__(self, hf_processor: Any, vision: Qwen2_5_VLVision):
        super().__init__(hf_processor)
        tower = vision.tower
        wanted = {"patch_size": tower.patch_size, "merge_size": tower.spatial_merge_size,
                  "temporal_patch_size": tower.temporal_patch_size}
        for name, value in wanted.items():
            if getattr(hf_processor, name, None) != value:
                raise ValueError(f"preprocessor_config.json: {name} {getattr(hf_processor, name, None)!r} differs "
                                 f"from the vision tower's {value}")
        self.merge = tower.spatial_merge_size

    def __call__(self, image: Any) -> ProcessedImage:
        out = self.hf(images=[image], return_tensors="np")
        _, h, w = (int(v) for v in out["image_grid_thw"][0])
        rows, cols = h // self.merge, w // self.merge
        return ProcessedImage(out["pixel_values"].astype(np.float32, copy=False), rows * cols, (rows, cols))


def load_image_processor(model_dir: str | None, vision: VisionConfig | Qwen2_5_VLVision) -> ImageProcessor:
    import transformers

    config = Path(model_dir) / "preprocessor_config.json" if model_dir else None
    kind = json.loads(config.read_text()).get("image_processor_type") if config and config.is_file() else None
    if isinstance(vision, Qwen2_5_VLVision):
        hf_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
        return QwenImageProcessor(_hf_processor(hf_class, model_dir, kind, QWEN_PROCESSORS, dict(
            patch_size=vision.tower.patch_size, merge_size=vision.tower.spatial_merge_size,
            temporal_patch_size=vision.tower.temporal_patch_size)), vision)
    hf_class = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    size = vision.image_size
    return ClipImageProcessor(_hf_processor(hf_class, model_dir, kind, CLIP_PROCESSORS, dict(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size})), vision)


def _hf_processor(hf_class: Any, model_dir: str | None, kind: str | None, accepted: tuple[str, ...],
                  defaults: dict[str, Any]) -> Any:
    """The checkpoint's processor when it names one (refused unless one of `accepted`), else
    the family's defaults."""
    if kind is None and model_dir and (Path(model_dir) / "preprocessor_config.json").is_file():
        kind = accepted[0]  # a config without the field: the family's own processor
    if kind is None:
        return hf_class(**defaults)
    if kind not in accepted:
        raise ValueError(f"preprocessor_config.json: image processor {kind!r} is not supported "
                         f"(supported: {', '.join(accepted)})")
    return hf_class.from_pretrained(model_dir)
