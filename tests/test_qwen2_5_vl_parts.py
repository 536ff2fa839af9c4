"""Qwen2.5-VL parts against HF transformers on a tiny random model: the vision encoder (windows,
full-attention blocks, merger, batching over images of different grids) and M-RoPE (positions,
whole and by chunks, and the rotary application)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen  # noqa: E402

from radixlm.srt.core.image_positions import rope_delta, rope_positions  # noqa: E402
from radixlm.srt.executor.models.mrope import MRotaryEmbedding  # noqa: E402
from radixlm.srt.io_struct import ImageInput  # noqa: E402
from radixlm.srt.executor.models.qwen2_5_vl_vision import (  # noqa: E402
    Qwen2_5_VisionEncoder, VisionConfig, load_vision_weights)

IMAGE, VISION_START, VISION_END = 60, 58, 59
PIXELS = {(4, 4): (56, 56), (8, 6): (112, 84), (6, 10): (84, 140), (8, 8): (112, 112)}  # grid h, w -> image h, w


@pytest.fixture(scope="module")
def hf_model() -> Qwen2_5_VLForConditionalGeneration:
    config = Qwen2_5_VLConfig(
        # Windows of 56 px = 2 merge blocks a side: every test grid has several, some partial.
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=40,
                           fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make every weight matter
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name or "ln_q" in name else 0.0))
    return model


def pixel_inputs(grids: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_thw from HF's image processor on random images (Pillow), else
    random patches in the processor's layout."""
    try:
        import numpy as np
        from PIL import Image
        from transformers import Qwen2VLImageProcessor
    except ImportError:
        grid_thw = torch.tensor([(1, h, w) for h, w in grids])
        return torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14), grid_thw
    rng = np.random.default_rng(sum(h * w for h, w in grids))
    images = [Image.fromarray(rng.integers(0, 256, (*PIXELS[grid], 3), dtype=np.uint8)) for grid in grids]
    out = Qwen2VLImageProcessor()(images=images, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, h, w] for h, w in grids]
    return out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module")
def encoder(hf_model) -> Qwen2_5_VisionEncoder:
    ours = Qwen2_5_VisionEncoder(VisionConfig.from_hf(hf_model.config.vision_config))
    load_vision_weights(ours, hf_model.state_dict())  # names as saved: model.visual.*
    return ours.eval()


@pytest.mark.parametrize("grids", [[(8, 8)], [(4, 4), (8, 6), (6, 10)]], ids=["one_image", "three_images"])
def test_vision_encoder_matches_hf(hf_model, encoder, grids):
    pixel_values, grid_thw = pixel_inputs(grids)
    with torch.no_grad():
        expected = hf_model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
        got = encoder(pixel_values, grid_thw)
    assert got.shape == expected.shape == (sum(h * w for h, w in grids) // 4, 40)
    assert (got - expected).abs().max().item() < 1e-4


def test_vision_encoder_video_grid_matches_hf(hf_model, encoder):
    # t > 1: each frame is its own full-attention segment and its own set of windows.
    grid_thw = torch.tensor([[2, 4, 6], [1, 4, 4]])
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = hf_model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
        got = encoder(pixel_values, grid_thw)
    assert (got - expected).abs().max().item() < 1e-4


def test_vision_encoder_refuses_bad_input(hf_model, encoder):
    pixel_values, grid_thw = pixel_inputs([(4, 4)])
    with pytest.raises(ValueError, match="grid_thw describes"):
        encoder(pixel_values[:-1], grid_thw)
    with pytest.raises(ValueError, match="multiples of 2"):
        encoder(pixel_values, torch.tensor([[1, 2, 8]]) + torch.tensor([[0, 1, 0]]))
    # A checkpoint's config.json names the channels in_chans.
    as_json = {k: v for k, v in hf_model.config.vision_config.to_dict().items() if k != "in_channels"}
    assert VisionConfig.from_hf({**as_json, "in_chans": 3}) == encoder.config
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf({**hf_model.config.vision_config.to_dict(), "hidden_act": "gelu"})
    weights = {k: v for k, v in hf_model.state_dict().items() if "visual." in k}
    with pytest.raises(ValueError, match="missing vision weights"):
        load_vision_weights(encoder, {k: v for k, v in weights.items() if "merger" not in k})
    with pytest.raises(ValueError, match="unexpected weight"):
        load_vision_weights(encoder, {**weights, "visual.deepstack.0.weight": torch.zeros(1)})


def prompt(grids: list[tuple[int, int]]) -> list[int]:
    """text, image, text, image, ..., text with vision start/end markers, as the chat template has them."""
    ids = [1, 2, 3]
    for i, (h, w) in enumerate(grids):
        ids += [VISION_START] + [IMAGE] * (h * w // 4) + [VISION_END] + [10 + i] * (2 + i)
    return ids


def image_records(ids: list[int], grids: list[tuple[int, int]]) -> list[ImageInput]:
    """Each image's tokens as the intake records them: offset, length and (rows, cols) of merged tokens."""
    records, cursor = [], 0
    for h, w in grids:
        offset = ids.index(IMAGE, cursor)
        records.append(ImageInput("00", offset, h * w // 4, b"", (0,), "float32", (h // 2, w // 2)))
        cursor = offset + h * w // 4
    return records


def test_mrope_positions_match_hf_get_rope_index(hf_model):
    grids = [(8, 6), (6, 10)]
    ids = torch.tensor([prompt(grids)])
    grid_thw = torch.tensor([(1, h, w) for h, w in grids])
    expected, expected_delta = hf_model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid_thw)
    images = image_records(ids[0].tolist(), grids)
    length = ids.shape[1]
    assert torch.equal(torch.tensor(rope_positions(images, 0, length)), expected[:, 0])
    assert rope_delta(images) == int(expected_delta)
    # Chunks take their slice, whether they cut an image or hold text only (then one row).
    for cuts in ([0, 7, 20, length], [0, 5, 17, 18, length]):
        pieces = [torch.tensor(rope_positions(images, a, b)).expand(3, -1) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces, dim=1), expected[:, 0])
    assert len(rope_positions(images, length - 2, length)) == 1
    assert len(rope_positions(images, 0, 4)) == 1 and len(rope_positions(images, 0, 5)) == 3
    # Tokens after the prompt continue at index + delta, as HF's generate places them.
    assert rope_positions(images, length, length + 1) == [[int(expected[0, 0].max()) + 1]]


def test_mrope_positions_of_text_and_of_images_without_a_grid():
    assert rope_positions([], 3, 6) == [[3, 4, 5]] and rope_delta([]) == 0
    plain = ImageInput("00", 1, 4, b"", (0,), "float32")  # LLaVA's: a plain run of positions
    assert rope_positions([plain], 0, 6) == [[0, 1, 2, 3, 4, 5]] and rope_delta([plain]) == 0


def test_mrope_rotary_matches_hf(hf_model):
    text_config = hf_model.config.text_config
    grids = [(4, 4), (6, 10)]
    ids = prompt(grids)
    positions = torch.tensor(rope_positions(image_records(ids, grids), 0, len(ids)))
    num_tokens, head_dim = len(ids), 16
    torch.manual_seed(1)
    q, k = torch.randn(num_tokens, 2, head_dim), torch.randn(num_tokens, 1, head_dim)

    hf_rotary = hf_qwen.Qwen2_5_VLRotaryEmbedding(text_config)
    cos, sin = hf_rotary(q, positions[:, None, :])
    expected_q, expected_k = hf_qwen.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    rotary = MRotaryEmbedding(text_config, head_dim, 10000.0, 256, (2, 3, 3))
    got_q, got_k = rotary(positions, q, k)
    assert (got_q - expected_q[0].transpose(0, 1)).abs().max().item() < 1e-5
    assert (got_k - expected_k[0].transpose(0, 1)).abs().max().item() < 1e-5
    # One row (text, decode) is plain rope at that position: the same as three equal rows.
    one_row = positions[0, :4]
    for plain, gathered in zip(rotary(one_row, q[:4], k[:4]), rotary(one_row.expand(3, -1), q[:4], k[:4])):
        assert torch.equal(plain, gathered)
