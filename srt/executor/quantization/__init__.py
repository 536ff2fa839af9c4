"""Weight and KV-cache quantization (`--quantization`, `--kv-cache-dtype`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kernel_options import KernelOptions

if TYPE_CHECKING:
    import torch


def apply_quantization(model: "torch.nn.Module", quantization: str | None, device: "torch.device",
                       checkpoint_fp8_scales: dict[str, "torch.Tensor"] | None = None,
                       options: KernelOptions = KernelOptions()) -> None:
    """The runner's one call after loading: an FP8 checkpoint's projections stay FP8 with their
    scales; otherwise the weights are quantized as `quantization` (--quantization) asks."""
    if checkpoint_fp8_scales:
        from .fp8_checkpoint import use_checkpoint_fp8

        use_checkpoint_fp8(model, device, checkpoint_fp8_scales, options)
    elif quantization == "fp8":
        from .fp8 import quantize_model_fp8

        quantize_model_fp8(model, device, options)
