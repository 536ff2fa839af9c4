"""The native (SGLang-compatible) HTTP API against a real server process and the default model."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def _post(server, path, body, **kw):
    with server.client() as c:
        return c.post(path, json=body, **kw)


def test_generate_single_and_batch(server):
    one = _post(server, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY}).json()
    assert one["text"].startswith(" Paris")
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(one["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    batch = _post(server, "/generate", {"text": ["The capital of France is", "1, 2, 3, 4,"],
                                        "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]
    ids = _post(server, "/generate", {"input_ids": [[504, 3575, 282, 4649, 314]], "sampling_params": GREEDY}).json()
    assert ids[0]["output_ids"] == one["output_ids"]


def test_stream_concatenates_to_final_text(server):
    body = {"text": "Write a haiku about the moon.", "sampling_params": {"temperature": 0, "max_new_tokens": 24},
            "stream": True}
    chunks = []
    with server.client() as c, c.stream("POST", "/generate", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line.removeprefix("data: ")))
    assert len(chunks) > 1
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = _post(server, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))


@pytest.fixture(scope="module")
def incremental_server():
    from benchmarks.harness import ServerProcess

    srv = ServerProcess("--max-total-tokens", "4096", "--incremental-streaming-output")
    yield srv
    srv.stop()


def test_incremental_stream_events_add_up_to_the_answer(incremental_server):
    """--incremental-streaming-output: each event holds what is new (text, ids, logprobs)."""
    body = {"text": "Write a haiku about the moon.", "sampling_params": {"temperature": 0, "max_new_tokens": 24},
            "return_logprob": True, "top_logprobs_num": 2}
    with incremental_server.client() as c:
        with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            events = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                      if line and line != "data: [DONE]"]
        final = c.post("/generate", json=body).json()
    assert len(events) > 1 and all(e["output_ids"] for e in events)
    assert "".join(e["text"] for e in events) == final["text"]
    assert [t for e in events for t in e["output_ids"]] == final["output_ids"]
    streamed = [entry for e in events for entry in e["meta_info"]["output_token_logprobs"]]
    whole = final["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in streamed] == [t for _, t, _ in whole]
    # The second request's prompt comes from the radix cache: the same numbers to within rounding.
    assert [lp for lp, _, _ in streamed] == pytest.approx([lp for lp, _, _ in whole], abs=1e-3)
    assert events[-1]["meta_info"]["completion_tokens"] == 24


def test_logprobs(server):
    out = _post(server, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY,
                                      "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                      "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == 5 and meta["input_token_logprobs"][0][0] is None
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs"][0][2] == " Paris"
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_repeated_long_prefix_is_cached(server):
    prefix = "You are a careful assistant. " * 40
    _post(server, "/generate", {"text": prefix + "Question one?", "sampling_params": {"max_new_tokens": 1}})
    second = _post(server, "/generate", {"text": prefix + "Question two?", "sampling_params": {"max_new_tokens": 1}})
    assert second.json()["meta_info"]["cached_tokens"] > 200


def test_stop_string_is_trimmed_unless_no_stop_trim(server):
    base = {"text": "Count: 1, 2, 3, 4,", "sampling_params": {"temperature": 0, "max_new_tokens": 16, "stop": " 7"}}
    out = _post(server, "/generate", base).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 7"}
    assert out["text"] == " 5, 6,"
    kept = _post(server, "/generate", {**base, "sampling_params": {**base["sampling_params"], "no_stop_trim": True}})
    assert kept.json()["text"] == " 5, 6, 7"


@pytest.mark.parametrize("no_stop_trim, text", [(False, " 5, 6,"), (True, " 5, 6, 7")])
def test_stream_never_shows_a_trimmed_stop_regex_match(server, no_stop_trim, text):
    body = {"text": "Count: 1, 2, 3, 4,", "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                           "stop_regex": r" [7-9]", "no_stop_trim": no_stop_trim}}
    whole = _post(server, "/generate", body).json()
    with server.client() as c, c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert whole["text"] == chunks[-1]["text"] == text
    # Every chunk's text so far is a prefix of the final text: the match was never sent.
    assert all(text.startswith(c["text"]) for c in chunks)


def test_n_samples_share_the_prompt(server):
    out = _post(server, "/generate", {"text": "Pick a random fruit:", "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 5}}).json()
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in out)


def test_info_endpoints(server):
    with server.client() as c:
        assert c.get("/get_model_info").json()["context_length"] == 8192
        info = c.get("/get_server_info").json()
        assert info["kv"]["leaked"] == 0 and "api_key" not in info
        # Settings left unset are reported as the scheduler filled them in for its device.
        assert info["max_running_requests"] == 64 and info["chunked_prefill_size"] == 2048
        assert c.get("/health_generate").status_code == 200
        metrics = c.get("/metrics").text
        for name in ("radixlm_num_running_reqs", "radixlm_kv_usage", "radixlm_cache_hit_rate",
                     "radixlm_prompt_tokens_total", "radixlm_generation_tokens_total",
                     "radixlm_time_to_first_token_seconds_bucket", "radixlm_inter_token_latency_seconds_bucket"):
            assert name in metrics


async def _until_running(client) -> None:
    """Waits until the server decodes a request (instead of sleeping a fixed time)."""
    while (await client.get("/get_server_info")).json()["num_running_reqs"] < 1:
        await asyncio.sleep(0.05)


def test_abort_request_by_rid(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            gen = asyncio.create_task(c.post("/generate", json={
                "text": "Tell me a long story.", "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
            await asyncio.wait_for(_until_running(c), 120)
            assert (await c.post("/abort_request", json={"rid": "to-abort"})).status_code == 200
            return (await gen).json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 2000


@pytest.mark.parametrize("body, field", [
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": 5}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": [1, 10**9]}, "input_ids"),
    ({"text": "hi", "sampling_params": {"stop_regex": "(["}}, "stop_regex"),
    ({"text": "hi", "sampling_params": {"regex": "[0-9]+("}}, "regex"),
    ({"text": "hi", "sampling_params": {"json_schema": {"type": "object", "not": {}}}}, "json_schema"),
    ({"text": "hi", "bogus": 1}, "bogus"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
])
def test_bad_input_is_400_naming_the_field(server, body, field):
    resp = _post(server, "/generate", body)
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


def test_malformed_json_and_overlong_prompt(server):
    with server.client() as c:
        resp = c.post("/generate", content=b'{"text": "hi", ', headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
        long = c.post("/generate", json={"input_ids": [100] * 9000, "sampling_params": {"max_new_tokens": 1}})
        assert long.status_code == 400 and "context length" in long.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_concurrent_streams_with_disconnects_leave_no_leak(server):
    """64 streams; about a third of the clients hang up early. The rest finish, nothing leaks."""
    rng = random.Random(0)

    async def one(c: httpx.AsyncClient, i: int, disconnect: bool) -> str:
        body = {"text": f"Story number {i}: once upon a time", "stream": True,
                "sampling_params": {"temperature": 0.8, "max_new_tokens": 12, "seed": i}}
        async with c.stream("POST", "/generate", json=body) as resp:
            n = 0
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    return "done"
                n += 1
                if disconnect and n >= 2:
                    return "left"  # leaving the block closes the connection mid-stream
        return "eof"

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as c:
            plan = [rng.random() < 0.35 for _ in range(64)]
            results = await asyncio.gather(*(one(c, i, d) for i, d in enumerate(plan)))
            return plan, results

    plan, results = asyncio.run(run())
    assert all(r == ("left" if d else "done") for d, r in zip(plan, results))
    with server.client() as c:
        assert c.get("/health").status_code == 200
        for _ in range(50):  # aborts land at the scheduler's next step
            info = c.get("/get_server_info").json()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                break
            asyncio.run(asyncio.sleep(0.2))
        kv = info["kv"]
        assert kv["leaked"] == 0 and kv["protected"] == 0 and kv["held_by_requests"] == 0
        assert kv["free"] + kv["evictable"] == kv["capacity"]
