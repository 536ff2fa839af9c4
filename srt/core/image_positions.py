"""Rotary positions of a prompt whose images lie on a grid (M-RoPE: Qwen2.5-VL), without torch.

Each token has three position rows (temporal, height, width). A text token has the same value
on all three: its index plus the shift of the images before it. The tokens of an image with a
(rows, cols) grid at offset o all take t = o + shift, and h = t + row, w = t + col, row-major;
the image then advances the positions by max(rows, cols) instead of rows * cols, which is the
shift it adds. After the prompt every token is text at index + `rope_delta` (the shift of all
its images, <= 0), so decode steps need one row per token: a plain [B] tensor in CUDA graphs.

Images without a grid (LLaVA) are plain runs of positions and shift nothing. Positions of a
token depend on the tokens before it only, so KV cached under a prefix stays valid for every
prompt sharing that prefix (the same image has the same grid: the grid is part of its hash).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..io_struct import ImageInput


def grid_shift(image: ImageInput) -> int:
    """How much the image moves the positions of the tokens after it (0 without a grid)."""
    if image.token_grid is None:
        return 0
    rows, cols = image.token_grid
    return max(rows, cols) - rows * cols


def rope_delta(images: Sequence[ImageInput]) -> int:
    """Position minus index of every token after the prompt's last image."""
    return sum(grid_shift(image) for image in images)


def rope_positions(images: Sequence[ImageInput], start: int, end: int) -> list[list[int]]:
    """Positions of tokens [start, end): one row when all of them are text (the three rows
    agree), else three rows (t, h, w). `images` in prompt order."""
    if not any(image.token_grid for image in images):  # text models, LLaVA: plain positions
        return [list(range(start, end))]
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    on_grid = False
    shift, cursor = 0, start  # cursor: the first token of [start, end) not placed yet

    def text_until(stop: int) -> None:
        nonlocal cursor
        stop = min(stop, end)
        if cursor < stop:
            run = range(cursor + shift, stop + shift)
            t.extend(run), h.extend(run), w.extend(run)
            cursor = stop

    for image in images:
        if image.token_grid is None:
            continue
        first, last = image.offset, image.offset + image.length
        if last <= start:
            shift += grid_shift(image)
            continue
        if first >= end:
            break
        text_until(first)
        rows, cols = image.token_grid
        base = first + shift
        for j in range(cursor - first, min(last, end) - first):
            t.append(base)
            h.append(base + j // cols)
            w.append(base + j % cols)
        on_grid = True
        cursor = min(last, end)
        shift += grid_shift(image)
    text_until(end)
    return [t, h, w] if on_grid else [t]
