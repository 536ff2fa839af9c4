"""Placeholder expansion: each image's one placeholder token in a prompt becomes as many tokens
as the tower gives the image features, carrying the image's pseudo ids."""

from __future__ import annotations


def placeholder_positions(ids: list[int], image_token_id: int) -> list[int]:
    return [i for i, t in enumerate(ids) if t == image_token_id]


def expand(ids: list[int], image_token_id: int, image_ids: list[list[int]],
           field: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(the prompt with placeholder k replaced by image_ids[k], each image's (offset, length)).
    ValueError naming `field` when the prompt's placeholders and the images do not pair up."""
    positions = placeholder_positions(ids, image_token_id)
    if len(positions) != len(image_ids):
        raise ValueError(f"{field}: the prompt has {len(positions)} image placeholders for {len(image_ids)} images "
                         "(one placeholder per image, where it goes)")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for position, tokens in zip(positions, image_ids):
        out.extend(ids[last:position])
        spans.append((len(out), len(tokens)))
        out.extend(tokens)
        last = position + 1
    out.extend(ids[last:])
    return out, spans
