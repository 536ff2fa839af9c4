"""M-RoPE (Qwen2-VL, Qwen2.5-VL): three position rows (temporal, height, width) per token.

Text tokens have the same position on all three rows; an image's merged tokens take
(start, start + row, start + col) over its merged grid, and the text after it continues at the
image's largest position + 1. The rotary pairs of a head are split by `mrope_section` among the
three rows. Decode tokens are text: position = sequence index + the prompt's delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def mrope_positions(input_ids: Sequence[int] | torch.Tensor, image_token_id: int,
                    image_grids: Sequence[Sequence[int]], spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, len(input_ids)] (int64) of a whole prompt and its delta (max position + 1 -
    prompt length), which places every later token at its sequence index + delta.

    image_grids: (t, h, w) in patches per image, in prompt order, as the processor reports them;
    image i must appear as t*h*w / merge**2 consecutive image tokens. A chunk of the prompt takes
    its slice of these positions.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    is_image = (ids == image_token_id).tolist()
    positions = torch.empty(3, len(is_image), dtype=torch.long)
    cursor, next_pos = 0, 0  # next token index to place; its position if it is text

    def place_text(end: int) -> None:
        nonlocal cursor, next_pos
        positions[:, cursor:end] = torch.arange(next_pos, next_pos + end - cursor)
        next_pos += end - cursor
        cursor = end

    m = spatial_merge_size
    for i, grid in enumerate(image_grids):
        t, h, w = (int(v) for v in grid)
        if t != 1:
            raise ValueError(f"image_grid_thw[{i}]: t={t}; video (several frames) is not supported")
        if h % m or w % m:
            raise ValueError(f"image_grid_thw[{i}]={(t, h, w)}: h and w must be multiples of {m}")
        try:
            start = is_image.index(True, cursor)
        except ValueError:
            raise ValueError(f"input_ids: {i} images' tokens found, but {len(image_grids)} image grids") from None
        place_text(start)
        rows, cols = h // m, w // m
        end = start + rows * cols
        if end > len(is_image) or not all(is_image[start:end]):
            raise ValueError(f"input_ids: image {i} needs {rows * cols} consecutive image tokens at {start}")
        grid_rows, grid_cols = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[0, start:end] = next_pos
        positions[1, start:end] = next_pos + grid_rows.flatten()
        positions[2, start:end] = next_pos + grid_cols.flatten()
        cursor, next_pos = end, next_pos + max(rows, cols)
    if True in is_image[cursor:]:
        raise ValueError(f"input_ids: more image tokens than the {len(image_grids)} image grids describe")
    place_text(len(is_image))
    return positions, next_pos - len(is_image)


def mrope_decode_positions(seq_indices: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Positions [3, N] of text tokens after the prompt: seq_indices [N] (index in its sequence),
    deltas [N] (its request's prompt delta)."""
    return (seq_indices + deltas).expand(3, -1)


def mrope_params(hf_text_config: Any) -> tuple[float, tuple[int, ...]]:
    """(rope_theta, mrope_section) of a Qwen2.5-VL text config; refuses scaled rope by name."""
    params = getattr(hf_text_config, "rope_parameters", None) or getattr(hf_text_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"text_config.rope_parameters.rope_type={rope_type!r} is not supported with M-RoPE")
    theta = params.get("rope_theta", getattr(hf_text_config, "rope_theta", None))
    if theta is None:
        raise ValueError("text_config: rope_theta is missing")
    return float(theta), tuple(params.get("mrope_section", (16, 24, 24)))


def mrope_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    return 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                  mrope_section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] (float32) for positions [3, T]: rotary pair j turns by the row that
    mrope_section assigns it (section i -> row i % 3)."""
    pairs = inv_freq.shape[0]
    if sum(mrope_section) != pairs:
        raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to head_dim / 2 = {pairs}")
    row_of_pair = torch.repeat_interleave(torch.arange(len(mrope_section)) % 3, torch.tensor(mrope_section))
    row_of_pair = row_of_pair.to(positions.device)
    pair_positions = positions[row_of_pair].float()  # [pairs, T]: each pair's own row
    angles = pair_positions.T * inv_freq.to(positions.device)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_mrope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary of q [T, H, D] and k [T, Hkv, D] by cos/sin [T, D], in float32."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        half = x.shape[-1] // 2
        turned = torch.cat((-x_float[..., half:], x_float[..., :half]), dim=-1)
        return (x_float * cos[:, None] + turned * sin[:, None]).to(x.dtype)
    return rotate(q), rotate(k)
