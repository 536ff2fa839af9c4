"""What a request may send: how many images, how large, and from where. Every refusal is a
ValueError naming the field (HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageLimits:
    max_images: int  # per prompt (--max-images-per-request)
    max_pixels: int  # width * height of one decoded image (--max-image-pixels)
    allow_remote: bool = False  # fetch http(s) URLs (--allow-remote-images); the server must not fetch for anyone
    allow_paths: bool = False  # read local files: the in-process Engine only, never over HTTP

    def check_count(self, count: int, field: str) -> None:
        if count > self.max_images:
            raise ValueError(f"{field}: {count} images; at most {self.max_images} per request "
                             "(--max-images-per-request)")

    def check_pixels(self, size: tuple[int, int], field: str) -> None:
        width, height = size
        if width * height > self.max_pixels:
            raise ValueError(f"{field}: {width}x{height} is {width * height} pixels; at most {self.max_pixels} "
                             "(--max-image-pixels)")


def limits_from_settings(settings: Any, allow_paths: bool = False) -> ImageLimits:
    """The limits of ServerArgs' multimodal section; `allow_paths` for the in-process Engine."""
    return ImageLimits(settings.max_images_per_request, settings.max_image_pixels, settings.allow_remote_images,
                       allow_paths)
