"""`radixlm serve` on CUDA (FlashInfer, CUDA graphs, bf16) serving the official openai client."""

from __future__ import annotations

import concurrent.futures

import pytest

from gpu_helpers import llama3_tokenizer_path, small_llama_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from benchmarks.harness import ServerProcess

    config = small_llama_config(tmp_path_factory.mktemp("small-llama-server"))
    srv = ServerProcess("--model-path", config, "--load-format", "dummy", "--tokenizer-path", llama3_tokenizer_path(),
                        "--max-total-tokens", "65536")  # the GPU's batch defaults, as a user gets them
    yield srv
    srv.stop()


def test_openai_client_completions_on_gpu(gpu_server):
    import openai

    client = openai.OpenAI(base_url=f"{gpu_server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    prompt = "Once upon a time, " * 20

    def complete(i: int):
        return client.completions.create(model=model, prompt=prompt + str(i), max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})

    # Concurrent requests: decode runs batched (CUDA graph buckets with padding).
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(complete, range(8)))
    for r in results:
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    # The shared prompt was served from the radix cache for later requests.
    again = complete(0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert len("".join(chunk.choices[0].text for chunk in stream if chunk.choices)) > 0
    # A logit bias in a batch decoding from CUDA graphs with overlap scheduling: the biased
    # request gets its forced token, the others their greedy outputs.
    forced = 1000
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        biased = pool.submit(client.completions.create, model=model, prompt=prompt + "0", max_tokens=16,
                             temperature=0, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        plain = list(pool.map(complete, range(3)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama3_tokenizer_path())
    assert biased.result().choices[0].text == tokenizer.decode([forced] * 16)
    assert [p.choices[0].text for p in plain] == [r.choices[0].text for r in results[:3]]
    info = gpu_server.client().get("/get_server_info").json()
    assert info["kv"]["leaked"] == 0
    assert (info["max_running_requests"], info["chunked_prefill_size"]) == (512, 8192)  # CUDA's defaults


def test_aborted_stream_frees_its_memory_on_gpu(gpu_server):
    """With overlap scheduling a step is in flight when the client goes away."""
    import time

    import httpx

    body = {"text": "Tell me everything. " * 10, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": True}
    with httpx.stream("POST", f"{gpu_server.base_url}/generate", json=body, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 5:
                break
    deadline = time.time() + 30
    while True:
        info = gpu_server.client().get("/get_server_info").json()
        if info["num_running_reqs"] == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert info["num_running_reqs"] == 0 and info["kv"]["leaked"] == 0
