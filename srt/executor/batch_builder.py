"""Turns a step plan's parts into the ForwardBatch tensors the model runner consumes."""

from __future__ import annotations

import torch

from ..core.image_positions import rope_positions
from ..core.step import ExtendPlan
from .forward_batch import ForwardBatch, ForwardMode, ImageSlice


def build_extend_batch(plans: list[ExtendPlan], device: torch.device) -> ForwardBatch:
    """Positions are one row, or three (t, h, w) when a part feeds tokens of an image on a grid
    (M-RoPE); text tokens then repeat theirs on all three rows."""
    input_ids: list[int] = []
    rows: list[list[int]] = [[]]  # position rows; all of them the same length
    out_cache_loc: list[int] = []
    logit_rows: list[int] = []
    images: list[ImageSlice] = []
    for plan in plans:
        row0 = len(input_ids)
        fill = plan.req.fill_ids
        own = plan.extend_len - len(plan.drafts)
        images.extend(_image_slices(plan, row0, own))
        input_ids.extend(fill[plan.start:plan.start + own])
        input_ids.extend(plan.drafts)
        part_rows = rope_positions(plan.req.images, plan.start, plan.start + own)
        if len(part_rows) > len(rows):  # the batch's first gridded image: every row so far is text
            rows = [rows[0], list(rows[0]), list(rows[0])]
        drafts = range(plan.start + own + plan.req.rope_delta, plan.start + plan.extend_len + plan.req.rope_delta)
        for i, row in enumerate(rows):  # text parts repeat their one row
            row.extend(part_rows[i if len(part_rows) > 1 else 0])
            row.extend(drafts)
        out_cache_loc.extend(plan.slots)
        first = row0 + plan.first_logit_pos - plan.start
        logit_rows.extend(range(first, first + plan.logit_count))
    batch, grid_rows = _forward_batch(device, ForwardMode.EXTEND, input_ids, rows[0], out_cache_loc,
                                      [p.req.req_pool_idx for p in plans], [p.start for p in plans],
                                      [p.extend_len for p in plans], logit_rows, *rows[1:])
    if grid_rows:
        batch.positions = torch.stack([batch.positions, *grid_rows])
    batch.images = images
    return batch


def _image_slices(plan: ExtendPlan, row0: int, own: int) -> list[ImageSlice]:
    """The parts of the request's images among its tokens [start, start + own), which this
    batch feeds from row `row0` (a chunk may start or end inside an image)."""
    slices = []
    for image in plan.req.images:
        begin = max(plan.start, image.offset)
        end = min(plan.start + own, image.offset + image.length)
        if begin < end:
            slices.append(ImageSlice(image, begin - image.offset, end - image.offset, row0 + begin - plan.start))
    return slices


def build_decode_batch(parts: list[ExtendPlan], device: torch.device,
                       last_tokens: torch.Tensor | None = None) -> ForwardBatch:
    """Each request feeds its newest token at position `part.start`, whose KV goes to
    `part.slots[0]`: its last output token, or, for a request whose newest token has not
    reached the host yet (overlap scheduling), the one in `last_tokens` (the newest sampled
    token per table row, on the device). A token read back may have been replaced since
    (jump-forward retokenizes it): the host has the truth."""
    reqs = [p.req for p in parts]
    host_ids = [r.output_ids[-1] if not r.pending_tokens else 0 for r in reqs]
    pending = [1 if r.pending_tokens else 0 for r in reqs]
    starts = [p.start for p in parts]
    # After the prompt every token is text: one position row, shifted by the request's images (M-RoPE).
    positions = [p.start + p.req.rope_delta for p in parts]
    batch, (on_device,) = _forward_batch(device, ForwardMode.DECODE, host_ids, positions, [p.slots[0] for p in parts],
                                         [r.req_pool_idx for r in reqs], starts, [1] * len(reqs),
                                         range(len(reqs)), pending)
    if last_tokens is not None:
        batch.input_ids = torch.where(on_device.bool(), last_tokens[batch.req_pool_indices], batch.input_ids)
    return batch


def keeps_every_row(parts: list[ExtendPlan]) -> bool:
    """Whether every part keeps the logits of each token it feeds (speculative verify parts, and
    one-token parts beside them), its newest token being on the host: such a step can run as
    `build_verify_batch`."""
    return all(p.logit_count == p.extend_len and p.first_logit_pos == p.start and not p.input_logprobs
               and not p.req.pending_tokens for p in parts)


def build_verify_batch(parts: list[ExtendPlan], device: torch.device) -> ForwardBatch:
    """A verify step as a decode batch with one row per token: row i of a part is its request at
    position start + i, attending over the request's KV through that position, which this same
    forward writes for the rows before it (each layer stores the step's K/V, then attends). So
    it is causal over the drafts as an extend would be, and replays the decode CUDA graphs
    (an eager extend forward of a few tokens costs several decode steps on a GPU)."""
    input_ids: list[int] = []
    starts: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for part in parts:
        own = part.extend_len - len(part.drafts)
        input_ids.extend(part.req.fill_ids[part.start:part.start + own])
        input_ids.extend(part.drafts)
        starts.extend(range(part.start, part.start + part.extend_len))
        # Verified tokens follow the prompt: text, shifted by its images (M-RoPE).
        positions.extend(range(part.start + part.req.rope_delta, part.start + part.extend_len + part.req.rope_delta))
        rows.extend([part.req.req_pool_idx] * part.extend_len)
    slots = [slot for part in parts for slot in part.slots]
    batch, _ = _forward_batch(device, ForwardMode.DECODE, input_ids, positions, slots, rows, starts,
                              [1] * len(positions), range(len(positions)))
    return batch


def build_token_batch(parts: list[ExtendPlan], offset: int, tokens: torch.Tensor, device: torch.device) -> ForwardBatch:
    """A decode batch in which each part feeds one token already on the device, `tokens[i]`, at
    position `part.start + offset`, its KV going to `part.slots[offset]` (the draft model's
    forwards: each feeds the draft the previous one sampled)."""
    positions = [p.start + offset for p in parts]
    batch, _ = _forward_batch(device, ForwardMode.DECODE, [0] * len(parts), positions,
                              [p.slots[offset] for p in parts], [p.req.req_pool_idx for p in parts], positions,
                              [1] * len(parts), range(len(parts)))
    batch.input_ids = tokens
    return batch


def _forward_batch(device: torch.device, mode: ForwardMode, input_ids, positions, out_cache_loc, rows: list[int],
                   prefix_lens: list[int], extend_lens: list[int], logit_rows,
                   *extra_columns) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """The batch from its host columns (and any extra columns, copied along in the same
    host-to-device copy and returned as device tensors)."""
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    ids, pos, loc, req_idx, lens, logits, *extra = _to_device(device, input_ids, positions, out_cache_loc, rows,
                                                              seq_lens, logit_rows, *extra_columns)
    batch = ForwardBatch(mode=mode, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=req_idx,
                         req_pool_indices_cpu=rows, seq_lens=lens, seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens,
                         extend_lens_cpu=extend_lens, logit_rows=logits,
                         host_columns=(positions, out_cache_loc, logit_rows))
    return batch, extra


def _to_device(device: torch.device, *columns) -> list[torch.Tensor]:
    """int64 tensors on `device` for each list, through one host-to-device copy. Non-blocking:
    CUDA stages pageable memory before returning, and a blocking copy would wait for every
    step still running on the device (overlap scheduling builds a batch while one runs)."""
    lens = [len(c) for c in columns]
    flat = torch.tensor([v for c in columns for v in c], dtype=torch.int64).to(device, non_blocking=True)
    return list(flat.split(lens))
