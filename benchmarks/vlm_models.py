"""Vision-language checkpoints that tests and benchmarks build: tiny random LLaVA models saved
as a user's checkpoint directory (weights, tokenizer with an "<image>" token, CLIP image
processor config), and config-only directories of 7B shapes for dummy weights (GPU benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# The tests' tiny shapes; a benchmark passes its own.
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def with_image_token(tokenizer: Any, token: str = "<image>") -> Any:
    tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    return tokenizer


def _save_clip_processor(path: Path, image_size: int) -> None:
    import transformers as tf

    tf.CLIPImageProcessorPil(size={"shortest_edge": image_size},
                             crop_size={"height": image_size, "width": image_size}).save_pretrained(path)


def build_tiny_llava(path: Path, tokenizer: Any, *, text_type: str = "llama", strategy: str = "default",
                     layer: int = -2, image_size: int = 28, patch: int = 7, text: dict | None = None,
                     vision: dict | None = None, final_norm: float = 8.0) -> Any:
    """A small LLaVA (`text_type` "llama" or "qwen2" language model), every tensor random
    (seeded), saved with `tokenizer` (which has "<image>") and a CLIP image processor config
    into `path`; returns the HF model."""
    import torch
    import transformers as tf

    text_fields = dict(**(text or TINY_TEXT), vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    text_config = tf.LlamaConfig(**text_fields) if text_type == "llama" else tf.Qwen2Config(**text_fields)
    vision_config = tf.CLIPVisionConfig(**(vision or TINY_VISION), image_size=image_size, patch_size=patch)
    config = tf.LlavaConfig(vision_config=vision_config, text_config=text_config,
                            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                            vision_feature_select_strategy=strategy, vision_feature_layer=layer)
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # the tower's LayerNorms near 1, so that each image's signal reaches the text
                param.normal_(1.0 if "vision_tower" in name else 0.0, 0.1)
            elif "language_model" in name and ("q_proj" in name or "k_proj" in name):
                param.normal_(0.0, 0.3)  # peaked attention: wrong positions change the logprobs
            else:
                param.normal_(0.0, 0.05 if "embed" in name else 0.1)
        model.model.language_model.norm.weight.normal_(0.0, final_norm)  # spread logprobs (test_model_families)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _save_clip_processor(path, image_size)
    return model


# ---- 7B shapes, config only (load_format="dummy") ------------------------------------------------

@dataclass(frozen=True)
class VlmShape:
    """A vision-language model shape: its HF architecture, how to write its config directory
    (config, image processor, tokenizer with the image token) and the prompt text of one image."""

    architecture: str
    description: str
    write: Callable[[Path, Any], Any]  # (folder, tokenizer) -> the transformers config
    image_text: str


def _write_llava_7b(path: Path, tokenizer: Any) -> Any:
    """LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px (576 image tokens, feature layer -2) and Llama-2-7B
    layers, with the benchmark tokenizer's vocabulary (Llama-3's) instead of Llama-2's 32064."""
    import transformers as tf

    with_image_token(tokenizer)
    text = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                          vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    vision = tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                 num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
                                 hidden_act="quick_gelu")
    config = tf.LlavaConfig(vision_config=vision, text_config=text,
                            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                            vision_feature_select_strategy="default", vision_feature_layer=-2,
                            projector_hidden_act="gelu")
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _save_clip_processor(path, 336)
    return config


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def _write_qwen2_5_vl_7b(path: Path, tokenizer: Any) -> Any:
    """Qwen2.5-VL-7B-Instruct's config (a 448x448 image: 32x32 patches of 14, merged 2x2 into 256
    tokens), with the benchmark tokenizer plus Qwen's three vision tokens."""
    import transformers as tf

    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    start, pad, end = tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3, out_hidden_size=3584,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, vocab_size=152064,
                rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                tie_word_embeddings=False)
    config = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=pad,
                                 vision_start_token_id=start, vision_end_token_id=end,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tf.Qwen2VLImageProcessor(min_pixels=448 * 448, max_pixels=448 * 448).save_pretrained(path)
    return config


SHAPES: dict[str, VlmShape] = {
    "llava": VlmShape("LlavaForConditionalGeneration", "LLaVA-1.5-7B shape (CLIP-L/336 + Llama-2-7B layers, "
                      "Llama-3 vocabulary), dummy weights, bf16", _write_llava_7b, "<image>"),
    "qwen2.5-vl": VlmShape("Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL-7B shape, dummy weights, bf16",
                           _write_qwen2_5_vl_7b, "".join(QWEN_VISION_TOKENS)),
}
