"""Checkpoints that are already quantized (HF `quantization_config`).

FP8 checkpoints with per-tensor or per-channel scales (`quant_method: fp8`, a `weight_scale`
per projection) load as they are: their e4m3 values go into
the projections unchanged and each row of a fused projection gets the scale of the tensor it
came from (fp8_checkpoint.py). Everything else quantized is refused by its quant_method:
without this, the loader would cast the weights to the model dtype and drop their scales, a
model that runs and is wrong.
"""

from __future__ import annotations

from typing import Any


def checkpoint_quantization(hf_config: Any, source: str) -> str | None:
    """"fp8" for an FP8 checkpoint with per-tensor or per-channel scales, None for an unquantized
    one; raises for others (block-wise FP8, other methods)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method", "unknown")
    if method == "fp8":
        if config.get("weight_block_size"):
            raise ValueError(f"{source}: FP8 checkpoints with block-wise scales (quantization_config quant_method: "
                             f"fp8, weight_scale_inv, weight_block_size {config['weight_block_size']}) do not load "
                             "yet (per-tensor weight_scale ones do); load its bf16 original with --quantization fp8")
        return "fp8"
    raise ValueError(f"{source}: quantized checkpoints (quantization_config quant_method: {method}) are not supported")
