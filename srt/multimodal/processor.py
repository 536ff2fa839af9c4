"""The family's Hugging Face image processor: for LLaVA, CLIP's (resize the shortest edge,
center crop, rescale, normalize), from the checkpoint's preprocessor_config.json when it has
one, else CLIP's defaults at the tower's input size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..configs import VisionConfig

# What preprocessor_config.json may name; every one is CLIP's processing (the Pil one is what
# transformers >= 5 gives without torchvision; we always run that one, so pixels do not depend
# on whether torchvision is installed).
CLIP_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")


class ImageProcessor:
    """Decoded RGB image -> the tower's pixel values, float32 [C, H, W]."""

    def __init__(self, hf_processor: Any, vision: VisionConfig):
        self.hf = hf_processor
        crop = hf_processor.crop_size if hf_processor.do_center_crop else None
        if crop is None or (crop["height"], crop["width"]) != (vision.image_size, vision.image_size):
            raise ValueError(f"preprocessor_config.json: images must be center-cropped to the vision tower's "
                             f"{vision.image_size}x{vision.image_size} (crop_size is {crop})")
        # Part of every image's hash: the same pixels processed otherwise are another input.
        self.settings = json.dumps(hf_processor.to_dict(), sort_keys=True, default=str)

    def __call__(self, image: Any) -> np.ndarray:
        return self.hf(images=[image], return_tensors="np")["pixel_values"][0].astype(np.float32, copy=False)


def load_image_processor(model_dir: str | None, vision: VisionConfig) -> ImageProcessor:
    import transformers

    clip = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    config = Path(model_dir) / "preprocessor_config.json" if model_dir else None
    if config is not None and config.is_file():
        kind = json.loads(config.read_text()).get("image_processor_type", "CLIPImageProcessor")
        if kind not in CLIP_PROCESSORS:
            raise ValueError(f"preprocessor_config.json: image processor {kind!r} is not supported "
                             f"(supported: {', '.join(CLIP_PROCESSORS)})")
        return ImageProcessor(clip.from_pretrained(model_dir), vision)
    size = vision.image_size
    return ImageProcessor(clip(size={"shortest_edge": size}, crop_size={"height": size, "width": size}), vision)
