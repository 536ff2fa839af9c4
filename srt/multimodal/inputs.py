"""The intake's side of images: a prompt's images decoded, processed and hashed once
(`load`), then its placeholders expanded into the images' pseudo ids (`expand`), giving the
`ImageInput` records the scheduler receives. Called in worker threads (decoding and
processing take milliseconds to seconds), by srt/intake.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..configs import ModelConfig
from ..io_struct import ImageInput
from .decode import load_image
from .hashing import image_hash, pseudo_ids
from .limits import ImageLimits
from .placeholders import expand
from .processor import ImageProcessor, load_image_processor


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for a prompt: its hash, pixel values (float32, the tower's layout) and the
    tokens it expands into (with their grid, for M-RoPE)."""

    content_hash: str
    pixels: np.ndarray
    tokens: int
    token_grid: tuple[int, int] | None = None


class ImageInputs:
    def __init__(self, processor: ImageProcessor, limits: ImageLimits, image_token_id: int, vocab_size: int,
                 placeholder: str, video_token_id: int | None = None):
        self.processor = processor
        self.limits = limits
        self.image_token_id = image_token_id
        self.vocab_size = vocab_size
        # An image's text in a prompt, as a chat template writes it: "<image>" (LLaVA),
        # "<|vision_start|><|image_pad|><|vision_end|>" (Qwen2.5-VL).
        self.placeholder = placeholder
        self.video_token_id = video_token_id  # a video placeholder, refused (video is not served)

    @classmethod
    def for_model(cls, config: ModelConfig, tokenizer: Any, model_dir: str | None,
                  limits: ImageLimits) -> ImageInputs | None:
        """The model's image intake; None for a text-only model."""
        vision = config.vision
        if vision is None:
            return None
        placeholder = "".join(tokenizer.convert_ids_to_tokens(list(vision.placeholder_ids)))
        return cls(load_image_processor(model_dir, vision), limits, vision.image_token_id, config.vocab_size,
                   placeholder, getattr(vision, "video_token_id", None))

    def load(self, items: list[tuple[str, Any]], count_field: str) -> list[PreparedImage]:
        """Each (field, item) decoded within the limits, processed and hashed."""
        self.limits.check_count(len(items), count_field)
        prepared = []
        for field, item in items:
            image = load_image(item, field, self.limits)
            digest = image_hash(image.tobytes(), image.size, self.processor.settings)
            processed = self.processor(image)
            prepared.append(PreparedImage(digest, processed.pixels, processed.tokens, processed.token_grid))
        return prepared

    def expand(self, ids: list[int], images: list[PreparedImage], field: str) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder expanded, and the images' records."""
        if self.video_token_id is not None and self.video_token_id in ids:
            raise ValueError(f"{field}: video input is not supported (the prompt has a video placeholder); send "
                             "its frames as images")
        image_ids = [pseudo_ids(image.content_hash, image.tokens, self.vocab_size) for image in images]
        expanded, spans = expand(ids, self.image_token_id, image_ids, field)
        records = [ImageInput(image.content_hash, offset, length, image.pixels.tobytes(), tuple(image.pixels.shape),
                              image.pixels.dtype.name, image.token_grid)
                   for image, (offset, length) in zip(images, spans)]
        return expanded, records
