"""What one model forward needs to know about its batch: built by batch_builder.py
(build_extend_batch / build_decode_batch), read by the model runner and the attention backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..io_struct import ImageInput


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens after an (optional) cached prefix
    DECODE = "decode"  # one new token per request


@dataclass(frozen=True)
class ImageSlice:
    """The part of one image a prefill chunk computes: its placeholder tokens [begin, end),
    fed at the batch's token rows [row, row + end - begin)."""

    image: ImageInput
    begin: int
    end: int
    row: int


@dataclass
class ForwardBatch:
    """Tensors for one forward; the `*_cpu` lists mirror them on the host for Python loops.

    Token-level tensors have one row per new token (T rows); request-level ones have B rows.
    `seq_lens` count every token of a request after this step (prefix + new).
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] rotary positions; [3, T] (M-RoPE) when an extend feeds an image's grid
    out_cache_loc: torch.Tensor  # [T] KV slots where the new tokens' K/V go
    req_pool_indices: torch.Tensor  # [B] rows of the req-to-token table
    req_pool_indices_cpu: list[int]
    seq_lens: torch.Tensor  # [B]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]  # cached tokens before this step's new ones
    extend_lens_cpu: list[int]  # new tokens per request (all 1 for decode)
    logit_rows: torch.Tensor  # rows of the T hidden states that need logits
    # The host lists positions, out_cache_loc and logit_rows were made from (tensor parallelism
    # sends them to the other ranks without reading the device).
    host_columns: tuple[list[int], list[int], list[int]] | None = None
    # LoRA (--enable-lora): each token's adapter slot (-1: the base model; None: no adapters in
    # the batch), the slot loads to run first as (slot, handle, adapter path), and the handles
    # unloaded since the last forward. Tensor parallelism sends them to every rank.
    adapter_slots: list[int] | None = None
    adapter_loads: tuple[tuple[int, int, str], ...] = ()
    adapter_drops: tuple[int, ...] = ()
    # Vision-language models: the images this extend batch overlaps (decode batches have none).
    images: list[ImageSlice] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE
