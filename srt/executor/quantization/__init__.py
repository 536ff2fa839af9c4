"""Weight and KV-cache quantization (`--quantization`, `--kv-cache-dtype`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixlm.srt.server_args import ServerArgs


def apply_quantization(model: "torch.nn.Module", args: "ServerArgs", device: "torch.device") -> None:
    """The runner's one call after loading: quantizes the model's weights as `args` asks."""
    if args.quantization == "fp8":
        from radixlm.srt.executor.quantization.fp8 import quantize_model_fp8

        quantize_model_fp8(model, device)
