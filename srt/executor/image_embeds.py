"""A prefill batch's image features, before the language model runs: each image the batch
overlaps is looked up in the encoder cache by its content hash; the ones missing are encoded
by the model's vision tower, same-size images in one forward, and kept; the slices the batch
feeds are then gathered with the rows they replace."""

from __future__ import annotations

import numpy as np
import torch

from ..multimodal.encoder_cache import EncoderCache
from .forward_batch import ImageSlice


class ImageEmbedder:
    def __init__(self, model: torch.nn.Module, cache: EncoderCache, device: torch.device, dtype: torch.dtype):
        self.model = model  # has encode_images(pixels [B, C, H, W]) -> [B, tokens, hidden]
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
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for key, s in missing.items():
            by_shape.setdefault(tuple(s.image.shape), []).append(key)
        for keys in by_shape.values():
            pixels = torch.stack([_pixels(missing[key]) for key in keys]).to(self.device, self.dtype)
            encoded = self.model.encode_images(pixels)
            self.cache.ran(len(keys))
            for key, one in zip(keys, encoded):
                found[key] = one
                self.cache.put(key, one, one.numel() * one.element_size())
        return found


def _pixels(s: ImageSlice) -> torch.Tensor:
    image = s.image
    array = np.frombuffer(image.pixels, dtype=np.dtype(image.dtype)).reshape(image.shape)
    return torch.from_numpy(array.copy())
