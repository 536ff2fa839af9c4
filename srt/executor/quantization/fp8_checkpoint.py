"""FP8 checkpoints with per-tensor scales, loaded as they are.

The loader casts a checkpoint's e4m3 weights to the model dtype (exact: every e4m3 value is a
bf16 and an fp32 value) and keeps each projection's `weight_scale`. Here each projection that
had scales becomes an Fp8Linear holding the very same e4m3 values, with a per-row scale vector:
a fused projection (q|k|v, gate|up) takes, row by row, the scale of the tensor the row came
from (or the row's own, in checkpoints with one scale per output channel), so nothing is
quantized twice. Activations are quantized per token at run time, as with
--quantization fp8; a checkpoint's static `input_scale` is not used.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernel_options import KernelOptions
from ..models import checkpoint
from ..models.layers import is_plain_linear
from .fp8 import FP8, LINEAR_NAMES, SCALED_MM_ALIGN, Fp8Linear, check_fp8_device

logger = logging.getLogger(__name__)


def use_checkpoint_fp8(model: nn.Module, device: torch.device, scales: dict[str, torch.Tensor],
                       options: KernelOptions = KernelOptions()) -> int:
    """Turns the projections whose checkpoint tensors were FP8 into Fp8Linear; returns how many.
    `scales`: HF weight name (…q_proj.weight) -> its scale (one per tensor, or one per row)."""
    check_fp8_device(device, "an FP8 checkpoint")
    rows: dict[str, torch.Tensor] = {}  # our module -> per-row scales (NaN: no FP8 tensor came there)
    params = dict(model.named_parameters())
    for hf_name, scale in scales.items():
        target, index = checkpoint._target(hf_name.removeprefix("model."), model.config, model.family)
        if target not in params or not target.endswith(".weight"):
            raise ValueError(f"FP8 checkpoint: a weight_scale for {hf_name}, which is no projection of the model")
        module = target.removesuffix(".weight")
        vec = rows.setdefault(module, torch.full((params[target].shape[0],), float("nan")))
        vec[index[0] if index else slice(None)] = scale.to(vec.dtype)
    replaced = 0
    for module_name, vec in rows.items():
        parent_name, _, name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, name)
        if name not in LINEAR_NAMES or not is_plain_linear(linear):
            raise ValueError(f"FP8 checkpoint: {module_name} has FP8 weights but is not a projection that runs in FP8")
        if torch.isnan(vec).any():
            raise ValueError(f"FP8 checkpoint: {module_name} fuses tensors of which only some are FP8")
        weight = linear.weight.data
        out_f, in_f = weight.shape
        if out_f % SCALED_MM_ALIGN or in_f % SCALED_MM_ALIGN:  # _scaled_mm cannot run it: the scaled values, in the model dtype
            weight.mul_(vec.to(weight.device, weight.dtype)[:, None])
            continue
        bias = linear.bias.data if linear.bias is not None else None
        setattr(parent, name, Fp8Linear(weight.to(FP8), vec.to(weight.device), bias, weight.dtype, options))
        replaced += 1
    logger.info("FP8 checkpoint: %d projections kept in e4m3 with their checkpoint scales", replaced)
    return replaced
