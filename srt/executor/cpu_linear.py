"""Projections on CPU through oneDNN, each weight packed once at load.

F.linear on CPU runs MKL's sgemm over the weight as stored. oneDNN's linear over a weight
reordered once into its own blocked layout (torch.ops.mkldnn._reorder_linear_weight, what
torch.compile's CPU backend does) took 0.57-0.80x the time of F.linear for the default model's
projections at 1 to 1024 rows on the development machine (AMD EPYC, AVX2;
benchmarks/bench_cpu_linear.py measures both). So float32 CPU models run every plain projection
and the LM head through it (`--disable-onednn-linear` turns it off). The packed tensor replaces
the stored weight, so the memory stays the same, except for a tied LM head: the embedding
lookup reads the plain rows, so the head packs a copy (vocabulary x hidden).

The deterministic mode uses the same modules on CPU for another property: oneDNN's product
gives a row the same bits at every row count but 1, so there a single row is padded to two
(batch_invariant.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .models.layers import is_plain_linear

PACKED_FOR_ROWS = 16  # the row count oneDNN's layout is chosen for: decode batches (1 to 1024 rows measured alike)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """x @ weight^T (+ bias) through oneDNN over a weight packed once; any leading axes.
    `min_rows`: fewer rows than this are padded with zeros (2 in the deterministic mode)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.min_rows = min_rows
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight: its shape, dtype and device are the stored one's (its values are
        oneDNN's layout, for oneDNN only)."""
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        rows = x2.shape[0]
        if rows < self.min_rows:
            x2 = torch.cat([x2, x2.new_zeros(self.min_rows - rows, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*lead, self.out_features)


class PackedHead(nn.Module):
    """The LM head's product (the model's `head_linear(x, weight)`) through a PackedLinear; the
    weight passed in is the one it packed."""

    def __init__(self, linear: PackedLinear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x)


def pack_projections(model: nn.Module, min_rows: int = 1,
                     dtypes: Iterable[torch.dtype] | None = (torch.float32,)) -> int:
    """Replaces every plain projection of `model` on the CPU (of `dtypes`; None: any) with a
    PackedLinear, the LM head included when the model has one; returns how many were packed.
    Projections packed before keep their packing and take the larger `min_rows`."""
    allowed = None if dtypes is None else set(dtypes)

    def packable(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and (allowed is None or weight.dtype in allowed)

    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                child.min_rows = max(child.min_rows, min_rows)
            elif is_plain_linear(child) and packable(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias, min_rows))
                packed += 1
    head = getattr(model, "head_linear", None)
    if isinstance(head, PackedHead):
        head.linear.min_rows = max(head.linear.min_rows, min_rows)
    elif head is not None and packable(model.lm_head_weight):
        lm_head = getattr(model, "lm_head", None)
        # An untied head was packed above; a tied one packs a copy of the embedding's rows.
        linear = lm_head if isinstance(lm_head, PackedLinear) else PackedLinear(model.lm_head_weight, None, min_rows)
        model.head_linear = PackedHead(linear)
        packed += 0 if linear is lm_head else 1
    return packed
