"""Vision-language models (LLaVA): tiny random models built with transformers' own classes
(CLIP tower + projector + a Llama or Qwen2 language model, the default model's tokenizer with an
"<image>" token), checked against HF on image+text logprobs and greedy tokens, through chunked
prefill and a cached prefix that ends inside an image; then a real server: the openai client
sending data-URL images, the radix cache and the encoder cache keyed by image content, and a
400 naming the field for each bad input."""

from __future__ import annotations

import base64
import http.server
import io
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.harness import ServerProcess
from benchmarks.vlm_models import build_tiny_llava, with_image_token
from radixlm.srt import Engine

LOGPROB_TOL = 2e-3
FINAL_NORM = 8.0
IMAGE_SIZE, PATCH = 28, 7  # 16 patches: 16 image tokens (17 with the CLS token kept)
SIZES = ((30, 40), (120, 90))  # two input resolutions; the processor resizes and crops both to 28x28
PROMPT_ONE = "Look at <image> and say what you see there, in one short sentence."
PROMPT_THREE = "First <image>, then <image>; and last <image> closes the set. Which differs?"
# (language model, vision_feature_select_strategy, vision_feature_layer)
KINDS = {"llama": ("llama", "default", -2), "qwen2_full": ("qwen2", "full", -1)}
MAX_IMAGES, MAX_PIXELS = 3, 200 * 200  # the server's limits in the tests below


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import default_model_path, load_tokenizer

    return with_image_token(load_tokenizer(default_model_path()))


def _build(kind: str, tokenizer, path: Path) -> torch.nn.Module:
    """A tiny LLaVA of `kind`, every tensor random, saved with the tokenizer and a CLIP image
    processor config into `path` as a user's checkpoint directory is."""
    text_type, strategy, layer = KINDS[kind]
    return build_tiny_llava(path, tokenizer, text_type=text_type, strategy=strategy, layer=layer,
                            image_size=IMAGE_SIZE, patch=PATCH, final_norm=FINAL_NORM)


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    height, width = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _hf_inputs(model, tokenizer, path: Path, prompt: str, images: list[Image.Image]):
    """HF's input ids (each placeholder repeated once per feature token, as LlavaProcessor
    does) and pixel values, from the processor saved with the model."""
    import transformers as tf

    image_id = model.config.image_token_index
    per_image = (IMAGE_SIZE // PATCH) ** 2 + (model.config.vision_feature_select_strategy == "full")
    ids = []
    for token in tokenizer.encode(prompt, add_special_tokens=False):
        ids.extend([token] * (per_image if token == image_id else 1))
    pixels = tf.CLIPImageProcessorPil.from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    return ids, pixels


def _hf_logprobs(model, ids: list[int], pixels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels,
                       position_ids=None if positions is None else positions[None]).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _hf_greedy(model, ids: list[int], pixels: torch.Tensor, n: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _worst_text_difference(ours: list, ref: torch.Tensor, ids: list[int], image_id: int, start: int = 1) -> float:
    """max |ours - HF| over the positions from `start` whose token is text (an image's
    placeholders have no logprob: ours are None there)."""
    worst = 0.0
    for i in range(start, len(ids)):
        if ids[i] == image_id:
            assert ours[i][0] is None
        else:
            worst = max(worst, abs(ours[i][0] - ref[i - 1].item()))
    return worst


# ---------------------------------------------------------------- against HF transformers


@pytest.mark.parametrize("kind", list(KINDS))
def test_llava_matches_hf(kind: str, tokenizer, tmp_path: Path) -> None:
    """Prompt logprobs (one and three images, two input resolutions each) and greedy tokens."""
    model = _build(kind, tokenizer, tmp_path)
    image_id = model.config.image_token_index
    engine = Engine(model_path=str(tmp_path), max_total_tokens=4096)
    try:
        worst = 0.0
        for size in SIZES:
            for prompt, seeds in ((PROMPT_ONE, [1]), (PROMPT_THREE, [2, 3, 4])):
                images = [_image(size, seed) for seed in seeds]
                out = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0,
                                      image_data=images)
                ids, pixels = _hf_inputs(model, tokenizer, tmp_path, prompt, images)
                assert out["meta_info"]["prompt_tokens"] == len(ids)
                ours = out["meta_info"]["input_token_logprobs"]
                ref = _hf_logprobs(model, ids, pixels)
                worst = max(worst, _worst_text_difference(ours, ref, ids, image_id))
                # Not vacuous: another image, or positions counting each image as one token,
                # change HF's logprobs of the text after it.
                other = _hf_inputs(model, tokenizer, tmp_path, prompt, [_image(size, 99)] + images[1:])[1]
                assert (_hf_logprobs(model, ids, other) - ref).abs().max().item() > 10 * LOGPROB_TOL
                steps = [int(not (t == image_id and ids[i - 1] == image_id)) for i, t in enumerate(ids)]
                one_each = torch.tensor(steps).cumsum(0) - 1
                assert (_hf_logprobs(model, ids, pixels, one_each) - ref).abs().max().item() > 10 * LOGPROB_TOL
        print(f"{kind}: max |logprob difference| against HF {worst:.2e}")
        assert worst <= LOGPROB_TOL

        images = [_image(SIZES[0], seed) for seed in (5, 6, 7)]
        ids, pixels = _hf_inputs(model, tokenizer, tmp_path, PROMPT_THREE, images)
        expected = _hf_greedy(model, ids, pixels)
        assert len(set(expected)) > 2, f"degenerate reference output {expected}"
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert engine.generate(PROMPT_THREE, params, image_data=images)["output_ids"] == expected
    finally:
        engine.shutdown()


def test_chunked_prefill_and_a_cached_prefix_cut_through_an_image(tokenizer, tmp_path: Path) -> None:
    """Chunks of 8 tokens cut the 16 image tokens (at offset 3) three ways; then a request whose
    cached prefix ends inside the image (logprob_start_len there stops the radix match) computes
    the image's rest from its features alone. Both give HF's tokens and logprobs."""
    model = _build("llama", tokenizer, tmp_path)
    image_id = model.config.image_token_index
    images = [_image(SIZES[1], 7)]
    ids, pixels = _hf_inputs(model, tokenizer, tmp_path, PROMPT_ONE, images)
    offset = ids.index(image_id)
    assert 0 < offset % 8 and (offset + 16) % 8
    engine = Engine(model_path=str(tmp_path), max_total_tokens=4096, chunked_prefill_size=8)
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert engine.generate(PROMPT_ONE, params, image_data=images)["output_ids"] == _hf_greedy(model, ids, pixels)

        start = offset + 10  # inside the image
        out = engine.generate(PROMPT_ONE, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start,
                              image_data=images)
        assert out["meta_info"]["cached_tokens"] == start - 1
        lps = out["meta_info"]["input_token_logprobs"]
        ref = _hf_logprobs(model, ids, pixels)
        padded = [None] * start + lps  # entries from logprob_start_len on
        assert _worst_text_difference(padded, ref, ids, image_id, start=start) <= LOGPROB_TOL
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    _build("llama", tokenizer, path)
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--max-images-per-request",
                        str(MAX_IMAGES), "--max-image-pixels", str(MAX_PIXELS))
    yield srv
    srv.stop()


def _generate(client, image_data, text: str = PROMPT_ONE) -> dict:
    response = client.post("/generate", json={"text": text, "image_data": image_data,
                                              "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def _encoder(client) -> dict:
    return client.get("/get_server_info").json()["encoder_cache"]


def test_openai_client_sends_data_url_images(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    content = [{"type": "text", "text": "Compare"},
               {"type": "image_url", "image_url": {"url": _data_url(_image((50, 50), 11))}},
               {"type": "text", "text": "with"},
               {"type": "image_url", "image_url": {"url": _data_url(_image((64, 48), 12), "JPEG"), "detail": "high"}}]
    reply = client.chat.completions.create(model="llava", messages=[{"role": "user", "content": content}],
                                           max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
    assert reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens > 2 * 16  # both images' tokens count


def test_the_same_image_hits_both_caches_and_different_images_share_nothing(server, tokenizer) -> None:
    with server.client() as client:
        assert client.post("/flush_cache").status_code == 200
        before = _encoder(client)
        url = _data_url(_image((40, 30), 21))
        first = _generate(client, url)
        assert first["cached_tokens"] == 0
        again = _generate(client, [url])  # a list of one is the same request
        # Everything but the last token comes from the radix cache, the image's 16 tokens included.
        assert again["cached_tokens"] == again["prompt_tokens"] - 1 > 16
        # Without its KV the image's features come from the encoder cache: the encoder ran once.
        assert client.post("/flush_cache").status_code == 200
        assert _generate(client, url)["cached_tokens"] == 0
        after = _encoder(client)
        assert after["encoded_images"] - before["encoded_images"] == 1
        assert after["hits"] - before["hits"] == 1
        metrics = client.get("/metrics").text
        assert f"radixlm_encoder_cache_encoded_images {float(after['encoded_images'])}" in metrics

        # Another image after the same text: only the text before the image is shared.
        other = _generate(client, _data_url(_image((40, 30), 22)))
        ids = tokenizer.encode(PROMPT_ONE, add_special_tokens=False)
        assert other["cached_tokens"] == ids.index(tokenizer.convert_tokens_to_ids("<image>"))


def _tiff_base64() -> str:
    buffer = io.BytesIO()
    _image((20, 20), 31).save(buffer, "TIFF")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(("body", "field", "message"), [
    ({"image_data": base64.b64encode(b"these bytes are no image").decode()}, "image_data", "cannot decode"),
    ({"image_data": "data:image/png;base64,@@@"}, "image_data", "cannot decode|base64"),
    ({"image_data": _tiff_base64()}, "image_data", "unsupported image format 'TIFF'"),
    ({"image_data": "data:text/plain;base64,aGVsbG8="}, "image_data", "unsupported format"),
    ({"text": "<image>" * 4, "image_data": [_data_url(_image((20, 20), s)) for s in range(4)]}, "image_data",
     "at most 3"),
    ({"image_data": _data_url(_image((201, 200), 32))}, "image_data", "at most 40000"),
    ({"image_data": "https://example.com/cat.png"}, "image_data", "--allow-remote-images"),
    ({"image_data": "/etc/hosts"}, "image_data", "local file paths"),
    ({"image_data": ["/tmp/cat.png"]}, "image_data[0]", "local file paths"),
    ({"text": "No placeholder here.", "image_data": _data_url(_image((20, 20), 33))}, "text", "0 image placeholders"),
    ({"image_data": 7}, "image_data", "expected a base64 string"),
])
def test_bad_images_get_400_naming_the_field(server, body: dict, field: str, message: str) -> None:
    with server.client() as client:
        response = client.post("/generate", json={"text": PROMPT_ONE, "sampling_params": {"max_new_tokens": 1},
                                                  **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field
        assert re.search(message, error["message"]), error["message"]


def test_a_bad_chat_image_gets_400_naming_its_part(server) -> None:
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}}]
    with server.client() as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages[0].content[1].image_url.url"
        assert client.get("/health").status_code == 200  # one bad request fails alone


def test_a_50_mb_image_body_gets_413_and_the_server_keeps_serving(server) -> None:
    """A ~50 MB base64 image is refused by its content-length, before any decoding, naming the
    flag; the next request with an image is served as usual."""
    with server.client() as client:
        limit = client.get("/get_server_info").json()["max_request_bytes"]
        payload = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(37_500_000)).decode()
        body = {"text": PROMPT_ONE, "image_data": payload, "sampling_params": {"max_new_tokens": 1}}
        assert len(payload) > limit  # the fixture keeps the default limit (8 MiB)
        response = client.post("/generate", json=body)
        assert response.status_code == 413, response.text
        assert f"over {limit} bytes (--max-request-bytes)" in response.json()["error"]["message"]
        assert _generate(client, _data_url(_image((40, 30), 23)))["prompt_tokens"] > 16


# ---------------------------------------------------------------- pieces


def test_a_text_only_model_refuses_images() -> None:
    from radixlm.srt.intake import Intake
    from radixlm.srt.server.openai_protocol import ChatMessage, OpenAIError

    intake = Intake(tokenizer=None, vocab_size=100, context_len=64)
    with pytest.raises(ValueError, match="^image_data: this model is text-only"):
        intake.batch(None, [5, 6], None, image_data=_data_url(_image((8, 8), 1)))
    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]})
    with pytest.raises(OpenAIError, match=r"^messages\[0\]\.content\[0\]: this model is text-only"):
        message.as_dict(0, takes_images=False)


def test_pseudo_ids_are_past_the_vocabulary_and_differ_per_image() -> None:
    from radixlm.srt.multimodal.hashing import PSEUDO_ID_LIMIT, image_hash, pseudo_ids

    one, two = (image_hash(_image((8, 8), seed).tobytes(), (8, 8), "clip") for seed in (1, 2))
    assert one != two and one == image_hash(_image((8, 8), 1).tobytes(), (8, 8), "clip")
    assert one != image_hash(_image((8, 8), 1).tobytes(), (8, 8), "clip at another size")
    ids_one, ids_two = pseudo_ids(one, 576, 49153), pseudo_ids(two, 576, 49153)
    assert all(49153 <= t < PSEUDO_ID_LIMIT for t in ids_one + ids_two)
    assert ids_one == pseudo_ids(one, 576, 49153) and ids_one[0] != ids_two[0]
    assert len(set(ids_one)) > 570


def test_images_travel_in_the_message_as_bytes() -> None:
    from radixlm.srt import io_struct
    from radixlm.srt.io_struct import ImageInput, TokenizedGenerateReq
    from radixlm.srt.sampling_params import SamplingParams

    pixels = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    image = ImageInput("ab" * 32, 1, 2, pixels.tobytes(), (3, 2, 2), "float32")
    msg = TokenizedGenerateReq(rid="r", input_ids=[5, 100000, 100001, 6], sampling_params=SamplingParams(),
                               images=[image])
    payload = io_struct.encode(msg)
    assert b"pickle" not in payload and io_struct.decode(payload) == msg


def test_remote_images_are_fetched_only_when_allowed() -> None:
    from radixlm.srt.multimodal.decode import load_image
    from radixlm.srt.multimodal.limits import ImageLimits

    buffer = io.BytesIO()
    _image((12, 10), 41).save(buffer, "PNG")
    body = buffer.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
    try:
        with pytest.raises(ValueError, match="allow-remote-images"):
            load_image(url, "image_data", ImageLimits(4, 10**6))
        image = load_image(url, "image_data", ImageLimits(4, 10**6, allow_remote=True))
        assert image.size == (10, 12) and image.mode == "RGB"
    finally:
        httpd.shutdown()


def test_the_encoder_cache_is_an_lru_bounded_in_bytes() -> None:
    from radixlm.srt.multimodal.encoder_cache import EncoderCache

    cache = EncoderCache(capacity_bytes=100)
    cache.put("a", "A", 60)
    cache.put("b", "B", 30)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("c", "C", 40)  # b goes
    cache.put("huge", "H", 101)  # larger than the cache: not kept
    assert cache.get("b") is None and cache.get("huge") is None and cache.get("c") == "C"
    assert cache.stats()["used_bytes"] == 100 and (cache.hits, cache.misses) == (2, 2)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["vision_config"].update(model_type="siglip_vision_model"), "'siglip_vision_model' vision tower"),
    (lambda c: c.update(vision_feature_layer=[-2, -1]), "several feature layers"),
    (lambda c: c.update(image_grid_pinpoints=[[336, 672]]), "image_grid_pinpoints"),
    (lambda c: c.update(vision_feature_select_strategy="pooled"), "vision_feature_select_strategy 'pooled'"),
    (lambda c: c["text_config"].update(model_type="gemma"), "'gemma' language model"),
])
def test_unimplemented_llava_options_are_refused_by_name(change, message: str, tokenizer, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from radixlm.srt.configs import ModelConfig

    fields = _build("llama", tokenizer, tmp_path).config.to_dict()
    change(fields)
    # As attributes, the way ModelConfig reads a config (transformers would refuse some of these itself).
    config = SimpleNamespace(**{k: SimpleNamespace(**v) if k.endswith("_config") else v for k, v in fields.items()})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


def test_tensor_parallelism_is_refused_for_a_vlm(tokenizer, tmp_path: Path) -> None:
    from radixlm.srt.executor.model_loader import load_model

    _build("llama", tokenizer, tmp_path)
    with pytest.raises(ValueError, match="tp_size: LlavaForConditionalGeneration .* not supported with tensor"):
        load_model(tmp_path, load_format="dummy", tensor_parallel=(0, 2))


@pytest.mark.parametrize(("settings", "message"), [
    ({"enable_lora": True, "max_lora_rank": 8}, "enable_lora: LoRA on LlavaForConditionalGeneration"),
    ({"enable_deterministic_inference": True}, "enable_deterministic_inference: with LlavaForConditionalGeneration"),
    ({"quantization": "fp8"}, "quantization: fp8 with LlavaForConditionalGeneration"),
])
def test_options_a_vlm_does_not_run_with_are_refused_by_name(settings: dict, message: str, tokenizer,
                                                             tmp_path: Path) -> None:
    _build("llama", tokenizer, tmp_path)
    with pytest.raises(ValueError, match=message):
        Engine(model_path=str(tmp_path), max_total_tokens=1024, **settings)


def test_a_program_with_two_images_a_fork_and_a_select_runs(server) -> None:
    """sgl.image in the language: the program's calls equal /generate with the same text and
    images, the fork's branches reuse the trunk's image KV, select scores after images."""
    import radixlm as sgl

    backend = sgl.RuntimeEndpoint(server.base_url)
    first, second = _image((50, 50), 21), _image((40, 60), 22)

    @sgl.function
    def compare(s, a, b):
        s += "Compare " + sgl.image(a) + " with " + sgl.image(b) + "."
        branches = s.fork(2)
        for branch, question in zip(branches, (" Colors:", " Shapes:")):
            branch += question + sgl.gen("answer", max_tokens=4, temperature=0)
        s += " Same?" + sgl.select("same", choices=[" yes", " no"])
        s["answers"] = [branch["answer"] for branch in branches]
        s["cached"] = [branch.get_meta_info("answer")["cached_tokens"] for branch in branches]

    state = compare.run(first, second, backend=backend)
    assert state.text().startswith("Compare <image> with <image>.")
    assert state["same"] in (" yes", " no")
    with server.client() as client:
        direct = client.post("/generate", json={
            "text": "Compare <image> with <image>. Colors:", "image_data": [_data_url(first), _data_url(second)],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert state["answers"][0] == direct["text"]
    assert all(cached >= 2 * 16 for cached in state["cached"])  # both images' tokens came from the cache
    # A batch of programs over images, and a model that takes none refuses by name.
    states = compare.run_batch([{"a": first, "b": second}, {"a": second, "b": first}], backend=backend)
    assert states[0]["answers"] == state["answers"] and all(s["same"] in (" yes", " no") for s in states)


def test_the_language_refuses_video_and_images_on_the_openai_backend() -> None:
    import radixlm as sgl

    with pytest.raises(NotImplementedError, match="video: not implemented"):
        sgl.video("clip.mp4", 8)

    @sgl.function
    def look(s):
        s += sgl.image(_data_url(_image((8, 8), 1))) + sgl.gen("x", max_tokens=1)

    with pytest.raises(sgl.BackendError, match="image: OpenAI sends no images"):
        look.run(backend=sgl.OpenAI("some-model", base_url="http://127.0.0.1:9", api_key="none"))
