"""A prefill batch's image features, before the language model runs: each image the batch
overlaps is looked up in the encoder cache by its content hash; the ones missing are encoded
by the model's vision tower, and kept; the slices the batch feeds are then gathered with the
rows they replace. The model says which images share a tower forward (`image_batch_key`: LLaVA
stacks same-size images, Qwen2.5-VL packs any sizes)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from ..io_struct import ImageInput
from ..multimodal.encoder_cache import EncoderCache
from .forward_batch import ImageSlice


class ImageEmbedder:
    def __init__(self, model: torch.nn.Module, cache: EncoderCache, device: torch.device, dtype: torch.dtype):
        # has image_batch_key(image) and encode_images(pixels per image, images) -> [tokens, hidden] per image
        self.model = model
        self.cache = cache
        self.device = device
        self.dtype = dtype

    def __call__(self, slices: list[ImageSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch rows the slices feed, their features [rows, hidden])."""
        features = self._features(slices)
        rows = torch.cat([torch.arange(s.row, s.row + s.end - s.begin) for s in slices]).to(self.device)
        return rows, torch.cat([features[s.image.content_hash][s.begin:s.end] for s in slices])

    def _features(self, slices: list[ImageSlice]) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageSlice] = {}
        for s in slices:
            key = s.image.content_hash
            if key in found or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is None:
                missing[key] = s
            else:
                found[key] = cached
        batches: dict[Hashable, list[str]] = {}
        for key, s in missing.items():
            batches.setdefault(self.model.image_batch_key(s.image), []).append(key)
        for keys in batches.values():
            images = [missing[key].image for key in keys]
            encoded = self.model.encode_images([_pixels(image).to(self.device, self.dtype) for image in images], images)
            self.cache.ran(len(keys))
            for key, one in zip(keys, encoded):
                found[key] = one
                self.cache.put(key, one, one.numel() * one.element_size())
        return found


def _pixels(image: ImageInput) -> torch.Tensor:
    array = np.frombuffer(image.pixels, dtype=np.dtype(image.dtype)).reshape(image.shape)
    return torch.from_numpy(array.copy())
