"""Qwen2.5-VL end to end against HF transformers, on a tiny random model built with transformers'
own classes (windowed vision tower + merger + a Qwen2 language model with M-RoPE; the default
model's tokenizer with Qwen's vision tokens): prompt logprobs with one and three images at two
resolutions, greedy tokens (decode positions shifted by each request's images, several requests
in one batch), a text-only prompt, chunked prefill and a cached prefix cutting through an
image, both caches hit by the same image, a chat through a real server and the official client,
and what is refused by name."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.harness import ServerProcess
from radixlm.srt import Engine

LOGPROB_TOL = 2e-3
FINAL_NORM = 8.0
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Two input resolutions: resized to 56x56 (2x2 tokens) and 140x112 (5x4 tokens, three windows).
SIZES = ((60, 50), (150, 110))
PROMPT_ONE = f"Look at {IMAGE} and say what you see there, in one short sentence."
PROMPT_THREE = f"First {IMAGE}, then {IMAGE}; and last {IMAGE} closes the set. Which differs?"
PROMPT_TEXT = "No picture here, only a sentence about the weather in spring."
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def _build(tokenizer, path: Path) -> torch.nn.Module:
    """A tiny Qwen2.5-VL, every tensor random, saved with the tokenizer and Qwen's image
    processor config into `path` as a user's checkpoint directory is."""
    import transformers as tf

    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    config = tf.Qwen2_5_VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]}),
        **ids)
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:  # near 1, so that each image reaches the text
                param.normal_(1.0, 0.1)
            elif "q_proj" in name or "k_proj" in name:  # peaked attention: positions matter (M-RoPE is tested)
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.05 if "embed" in name else 0.1)
        model.model.language_model.norm.weight.normal_(0.0, FINAL_NORM)  # spread logprobs (test_model_families)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tf.Qwen2VLImageProcessorPil().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return _build(tokenizer, path), path


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine(model_path=str(checkpoint[1]), max_total_tokens=4096)
    yield engine
    engine.shutdown()


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    height, width = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _hf_inputs(model, tokenizer, path: Path, prompt: str, images: list[Image.Image]) -> dict:
    """HF's inputs: each <|image_pad|> repeated once per merged token of its image (as
    Qwen2_5_VLProcessor does), pixel values, grids and the token types M-RoPE reads."""
    import transformers as tf

    image_id = model.config.image_token_id
    inputs: dict = {}
    tokens_per_image: list[int] = []
    if images:
        processed = tf.Qwen2VLImageProcessorPil.from_pretrained(path)(images=images, return_tensors="pt")
        inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        tokens_per_image = (processed["image_grid_thw"].prod(-1) // 4).tolist()
    ids: list[int] = []
    for token in tokenizer.encode(prompt, add_special_tokens=False):
        ids.extend([token] * (tokens_per_image.pop(0) if token == image_id else 1))
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "mm_token_type_ids": (input_ids == image_id).int(), **inputs}


def _hf_logprobs(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), ids[1:]]


def _hf_greedy(model, inputs: dict, n: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _worst_text_difference(ours: list, ref: torch.Tensor, ids: list[int], image_id: int, start: int = 1) -> float:
    """max |ours - HF| over the positions from `start` whose token is text (an image's tokens
    have no logprob: ours are None there)."""
    worst = 0.0
    for i in range(start, len(ids)):
        if ids[i] == image_id:
            assert ours[i][0] is None
        else:
            worst = max(worst, abs(ours[i][0] - ref[i - 1].item()))
    return worst


# ---------------------------------------------------------------- against HF transformers


def test_prompt_logprobs_match_hf(engine, checkpoint, tokenizer) -> None:
    """One and three images at two resolutions, and a text-only prompt on the same model."""
    model, path = checkpoint
    image_id = model.config.image_token_id
    worst = 0.0
    cases = [(prompt, [_image(size, seed) for seed in seeds]) for size in SIZES
             for prompt, seeds in ((PROMPT_ONE, [1]), (PROMPT_THREE, [2, 3, 4]))]
    for prompt, images in cases + [(PROMPT_TEXT, [])]:
        out = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0,
                              image_data=images or None)
        inputs = _hf_inputs(model, tokenizer, path, prompt, images)
        ids = inputs["input_ids"][0].tolist()
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        ref = _hf_logprobs(model, inputs)
        worst = max(worst, _worst_text_difference(out["meta_info"]["input_token_logprobs"], ref, ids, image_id))
        if images:  # not vacuous: another first image, or plain positions, change HF's logprobs
            other = _hf_inputs(model, tokenizer, path, prompt, [_image(images[0].size[::-1], 99)] + images[1:])
            assert (_hf_logprobs(model, other) - ref).abs().max().item() > 10 * LOGPROB_TOL
            plain = torch.arange(len(ids)).expand(3, 1, -1)
            assert (_hf_logprobs(model, {**inputs, "position_ids": plain}) - ref).abs().max().item() > 10 * LOGPROB_TOL
    print(f"qwen2.5-vl: max |logprob difference| against HF {worst:.2e}")
    assert worst <= LOGPROB_TOL


def test_greedy_tokens_match_hf_in_one_batch(engine, checkpoint, tokenizer) -> None:
    """Three prompts decode together, each row at its own index + delta (three images, one
    image, none); each gives HF's greedy tokens."""
    model, path = checkpoint
    cases = [(PROMPT_THREE, [_image(SIZES[1], s) for s in (5, 6, 7)]), (PROMPT_ONE, [_image(SIZES[0], 8)]),
             (PROMPT_TEXT, [])]
    expected = [_hf_greedy(model, _hf_inputs(model, tokenizer, path, prompt, images)) for prompt, images in cases]
    assert all(len(set(tokens)) > 2 for tokens in expected), f"degenerate reference output {expected}"
    outs = engine.generate([prompt for prompt, _ in cases], GREEDY, image_data=[images or None for _, images in cases])
    assert [out["output_ids"] for out in outs] == expected


def test_the_same_image_hits_both_caches(engine, checkpoint) -> None:
    engine.flush_cache()
    before = engine.scheduler.encoder_cache_info()
    image = _image(SIZES[1], 21)
    first = engine.generate(PROMPT_ONE, GREEDY, image_data=image)
    again = engine.generate(PROMPT_ONE, GREEDY, image_data=image)
    assert first["meta_info"]["cached_tokens"] == 0
    # Everything but the last token comes from the radix cache, the image's 20 tokens included.
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1 > 20
    assert again["output_ids"] == first["output_ids"]
    after = engine.scheduler.encoder_cache_info()
    assert after["encoded_images"] - before["encoded_images"] == 1  # the second prompt never reached the tower
    # Without its KV the image's features come from the encoder cache.
    engine.flush_cache()
    assert engine.generate(PROMPT_ONE, GREEDY, image_data=image)["output_ids"] == first["output_ids"]
    final = engine.scheduler.encoder_cache_info()
    assert final["encoded_images"] == after["encoded_images"] and final["hits"] > after["hits"]


def test_chunked_prefill_and_a_cached_prefix_cut_through_an_image(checkpoint, tokenizer) -> None:
    """Chunks of 7 tokens cut the 20 image tokens (at offset 4) three times; then a request whose
    cached prefix ends inside the image (logprob_start_len there stops the radix match) computes
    the image's rest, at its grid positions, from its features alone."""
    model, path = checkpoint
    image_id = model.config.image_token_id
    images = [_image(SIZES[1], 7)]
    inputs = _hf_inputs(model, tokenizer, path, PROMPT_ONE, images)
    ids = inputs["input_ids"][0].tolist()
    offset = ids.index(image_id)
    assert 0 < offset % 7 and (offset + 20) % 7
    engine = Engine(model_path=str(path), max_total_tokens=4096, chunked_prefill_size=7)
    try:
        assert engine.generate(PROMPT_ONE, GREEDY, image_data=images)["output_ids"] == _hf_greedy(model, inputs)
        start = offset + 11  # inside the image, on its third token row
        out = engine.generate(PROMPT_ONE, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start,
                              image_data=images)
        assert out["meta_info"]["cached_tokens"] == start - 1
        padded = [None] * start + out["meta_info"]["input_token_logprobs"]  # entries from logprob_start_len on
        assert _worst_text_difference(padded, _hf_logprobs(model, inputs), ids, image_id, start=start) <= LOGPROB_TOL
    finally:
        engine.shutdown()


def test_the_openai_client_chats_about_an_image_as_hf_generates(checkpoint, tokenizer) -> None:
    """A real server on the checkpoint: the official client sends a data-URL image between two
    text parts; the prompt is the chat template's rendering with the image's tokens in place
    (counted in usage), and the reply is HF's greedy continuation of it."""
    from openai import OpenAI

    model, path = checkpoint
    image = _image(SIZES[1], 31)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "Look at"}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": " and say what you see."}]
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    try:
        client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": content}],
                                               max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    finally:
        srv.stop()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Look at{IMAGE} and say what you see."}],
                                           tokenize=False, add_generation_prompt=True)
    inputs = _hf_inputs(model, tokenizer, path, prompt, [image])
    expected = _hf_greedy(model, inputs)
    assert len(set(expected)) > 2, f"degenerate reference output {expected}"
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]  # 20 image tokens among them
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_an_image_stands_for_qwens_vision_tokens_in_text(engine) -> None:
    """What sgl.image and a chat template without image parts write (/get_server_info's image_token)."""
    assert engine.intake.images.placeholder == IMAGE


# ---------------------------------------------------------------- refused by name


def test_a_video_placeholder_is_refused_by_name(engine) -> None:
    with pytest.raises(ValueError, match="^prompt: video input is not supported"):
        engine.generate("Watch <|vision_start|><|video_pad|><|vision_end|> closely.", {"max_new_tokens": 1})
    with pytest.raises(ValueError, match="prompt: the prompt has 1 image placeholders for 2 images"):
        engine.generate(PROMPT_ONE, {"max_new_tokens": 1}, image_data=[_image((30, 30), 1), _image((30, 30), 2)])


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn", factor=2.0), "rope type 'yarn'"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section"),
    (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config.hidden_act='gelu'"),
    (lambda c: c["vision_config"].update(out_hidden_size=32), "out_hidden_size 32"),
    (lambda c: c.update(image_token_id=10**6), "image_token_id 1000000"),
])
def test_unimplemented_options_are_refused_by_name(change, message: str, checkpoint) -> None:
    from radixlm.srt.configs import ModelConfig

    fields = checkpoint[0].config.to_dict()
    change(fields)
    config = SimpleNamespace(**{k: SimpleNamespace(**v) if k == "text_config" else v for k, v in fields.items()})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


def test_tensor_parallelism_and_another_image_processor_are_refused(checkpoint, tmp_path: Path) -> None:
    import json
    import shutil

    from radixlm.srt.configs import ModelConfig
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.srt.multimodal.processor import load_image_processor

    path = checkpoint[1]
    with pytest.raises(ValueError, match="tp_size: Qwen2_5_VLForConditionalGeneration .* not supported with tensor"):
        load_model(path, load_format="dummy", tensor_parallel=(0, 2))
    vision = ModelConfig.from_hf(checkpoint[0].config).vision
    shutil.copy(path / "preprocessor_config.json", tmp_path)
    fields = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**fields, "merge_size": 3}))
    with pytest.raises(ValueError, match="merge_size 3 differs from the vision tower's 2"):
        load_image_processor(str(tmp_path), vision)
    siglip = {**fields, "image_processor_type": "SiglipImageProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(siglip))
    with pytest.raises(ValueError, match="image processor 'SiglipImageProcessor' is not supported"):
        load_image_processor(str(tmp_path), vision)


def test_ngram_speculation_verifies_at_shifted_positions(checkpoint, tokenizer) -> None:
    """Draft tokens after the prompt are verified at index + delta, as decode steps feed them
    (this image prompt's output repeats a token, so prompt lookup drafts after it)."""
    model, path = checkpoint
    cases = [(PROMPT_THREE, [_image(SIZES[1], s) for s in (2, 3, 4)]), (PROMPT_TEXT, [])]
    expected = [_hf_greedy(model, _hf_inputs(model, tokenizer, path, prompt, images), 24) for prompt, images in cases]
    engine = Engine(model_path=str(path), max_total_tokens=4096, speculative_algorithm="ngram")
    try:
        outs = engine.generate([prompt for prompt, _ in cases], {**GREEDY, "max_new_tokens": 24},
                               image_data=[images or None for _, images in cases])
    finally:
        engine.shutdown()
    assert outs[0]["meta_info"].get("spec_verify_ct", 0) > 0
    assert [out["output_ids"] for out in outs] == expected
