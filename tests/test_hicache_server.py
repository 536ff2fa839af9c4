"""The hierarchical cache through real servers: a second server started on the first one's disk
tier serves a repeated 3000-token few-shot prefix from it (same output, cached tokens in
meta_info and in the official openai client's usage), /metrics and /get_server_info show every
tier, aborted streams leave no KV behind in any tier, and /flush_cache empties the disk tier
only when asked."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import openai
import pytest

from benchmarks.harness import ServerProcess, wait_until

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def tiered_server(storage_dir: str) -> ServerProcess:
    return ServerProcess("--max-total-tokens", "4096", "--enable-hierarchical-cache",
                         "--hicache-storage-backend", "file", "--hicache-storage-dir", storage_dir)


def generate(srv: ServerProcess, ids: list[int]) -> dict:
    with srv.client() as c:
        r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def server_info(srv: ServerProcess) -> dict:
    with srv.client() as c:
        return c.get("/get_server_info").json()


def assert_idle_and_no_leak(srv: ServerProcess) -> None:
    def idle() -> bool:
        info = server_info(srv)
        return info["num_running_reqs"] == info["num_waiting_reqs"] == 0

    wait_until(idle, 20, interval=0.2)
    info = server_info(srv)
    assert info["kv"]["leaked"] == 0 and info["kv"]["protected"] == 0, info["kv"]
    host = info["cache_tiers"]["host"]
    assert 0 <= host["used_tokens"] <= host["capacity_tokens"]


@pytest.fixture(scope="module")
def fewshot() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(100, 40000) for _ in range(3000)]


def test_a_second_server_serves_the_prefix_from_the_disk_tier(tmp_path, fewshot) -> None:
    storage = str(tmp_path / "kv")
    first = tiered_server(storage)
    try:
        cold = generate(first, fewshot + [11, 12, 13])
        assert cold["meta_info"]["cached_tokens"] == 0
    finally:
        first.stop()  # SIGTERM: the queued disk writes land first
    second = tiered_server(storage)
    try:
        again = generate(second, fewshot + [11, 12, 13])
        details = again["meta_info"]["cached_tokens_details"]
        assert details["storage"] >= 2944 and details["device"] == 0, details
        assert again["meta_info"]["cached_tokens"] == sum(details.values())
        assert again["output_ids"] == cold["output_ids"]

        # The official client sees them as cached prompt tokens (a new question on the prefix).
        client = openai.OpenAI(base_url=f"{second.base_url}/v1", api_key="none", max_retries=0)
        ids = fewshot + [21, 22]
        with second.client() as c:  # flush device and host: these come from disk again
            assert c.post("/flush_cache").status_code == 200
        completion = client.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0)
        assert completion.usage.prompt_tokens_details.cached_tokens >= 2944

        info = server_info(second)["cache_tiers"]
        assert info["storage"]["hit_tokens"] >= 2944  # since the flush and info["storage"]["files"] >= 46
        assert info["device"]["capacity_tokens"] == 4096 and info["host"]["capacity_tokens"] == 8192
        with second.client() as c:
            metrics = c.get("/metrics").text
        storage_hits = re.search(r'radixlm_cached_prompt_tokens_by_tier_total\{tier="storage"\} (\S+)', metrics)
        assert storage_hits and float(storage_hits.group(1)) >= 2944
        assert 'radixlm_cache_tier_capacity_tokens{tier="host"} 8192.0' in metrics

        # Aborted streams free their KV in every tier.
        def stream_and_drop(seed: int) -> None:
            body = {"input_ids": fewshot[:2000] + [seed] * 300,
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
            with httpx.Client(base_url=second.base_url, timeout=60, trust_env=False) as c:
                with c.stream("POST", "/generate", json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 3:
                            break  # the client goes away mid-stream

        workers = [threading.Thread(target=stream_and_drop, args=(s,)) for s in (31, 32, 33)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        time.sleep(0.5)
        assert_idle_and_no_leak(second)

        with second.client() as c:
            assert c.post("/flush_cache").status_code == 200
            assert server_info(second)["cache_tiers"]["storage"]["files"] >= 46  # kept without the flag
            assert c.post("/flush_cache?storage=true").status_code == 200
        assert server_info(second)["cache_tiers"]["storage"]["files"] == 0
    finally:
        second.stop()


def test_an_unwritable_storage_dir_fails_the_start_clearly(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="hicache-storage-dir"):
        tiered_server(str(blocker / "kv"))
