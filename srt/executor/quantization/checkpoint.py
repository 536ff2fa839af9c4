"""Checkpoints that are already quantized (HF `quantization_config`): none loads yet, so each is
refused by its quant_method. Without this, the loader would cast FP8 weights to the model dtype
and drop their scales: a model that runs and is wrong."""

from __future__ import annotations

from typing import Any


def check_checkpoint_quantization(hf_config: Any, source: str) -> None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method", "unknown")
    if method == "fp8":
        layout = (f"block-wise weight_scale_inv, weight_block_size {config['weight_block_size']}"
                  if config.get("weight_block_size") else "per-tensor weight_scale")
        raise ValueError(f"{source}: checkpoints already in FP8 (quantization_config quant_method: fp8, {layout}) "
                         "do not load yet; load its bf16 original with --quantization fp8 instead")
    raise ValueError(f"{source}: quantized checkpoints (quantization_config quant_method: {method}) are not supported")
