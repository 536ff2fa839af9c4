"""The router and `radixlm serve --dp-size 2` (issue 12, part 3) against real processes on the
default model: two replicas behind the cache-aware router keep each shared prefix on one replica
(cached-token fraction close to one server's, round-robin clearly lower), the native and OpenAI
routes through the official client, /metrics labelled by worker, 4xx passed through, and a
replica killed mid-run: requests that had not started streaming are retried and succeed,
started streams end with an error event, /health stays 200, then 503 with none left.

Servers: the suite's shared single server, one `--dp-size 2` process (its two replicas serve
the round-robin router too), and routers without a model. Pure parts (prefix tree, policy,
keys, metrics relabelling) are tested without processes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixlm.srt.router import request_keys
from radixlm.srt.router.policy import CacheAware, RoundRobin
from radixlm.srt.router.prefix_tree import PrefixTree
from radixlm.srt.router.worker_metrics import merge_worker_metrics
from radixlm.srt.router.workers import Worker
from benchmarks.harness import RouterProcess, ServerProcess, free_port, wait_until

KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- pure parts ---------------------------------------------------------------------------------

def test_prefix_tree_longest_match_split_and_lru_bound():
    tree = PrefixTree(max_chars_per_worker=40)
    tree.insert("system: be brief. user: hi", "a")
    tree.insert("system: be brief. user: bye", "b")
    assert tree.match("system: be brief. user: hi there", ["a", "b"]) == (26, {"a"})
    assert tree.match("system: be brief. user: b", ["a", "b"]) == (25, {"b"})
    assert tree.match("system: be", ["a", "b"]) == (10, {"a", "b"})
    assert tree.match("system: be brief. user: hi", ["b"]) == (24, {"b"})  # only the workers asked about
    assert tree.match("other", ["a", "b"]) == (0, set())
    for i in range(4):  # 40 more characters for "a": its oldest text goes first
        tree.insert(f"{i}" * 10, "a")
    assert tree.size("a") <= 40
    assert tree.match("system: be brief. user: hi", ["a"])[0] == 0
    assert tree.match("3333333333", ["a"]) == (10, {"a"})
    assert tree.match("system: be brief. user: bye", ["b"]) == (27, {"b"})  # "b" untouched
    tree.forget("b")
    assert tree.match("system: be brief. user: bye", ["a", "b"]) == (0, set()) and tree.size("b") == 0


def test_cache_aware_policy():
    tree = PrefixTree()
    policy = CacheAware(tree, balance_threshold=2, cache_threshold=0.5)
    a, b = Worker("a", healthy=True), Worker("b", healthy=True)
    long_prefix = "x" * 100
    first = policy.pick(long_prefix + "1", [a, b])
    policy.on_dispatch(long_prefix + "1", first)
    assert first is a  # loads tie, trees empty: the first by name
    # A new prefix goes to the worker holding less text (spreads groups over caches).
    other = policy.pick("y" * 100, [a, b])
    assert other is b
    a.in_flight = 2
    assert policy.pick(long_prefix + "2", [a, b]) is a  # the holder, within the threshold
    a.in_flight = 3
    assert policy.pick(long_prefix + "2", [a, b]) is b  # 3 - 0 > 2: the least loaded
    a.in_flight, b.in_flight = 0, 1
    assert policy.pick(None, [a, b]) is a  # no key: the least loaded
    # A short match counts as none: a new prefix, for the worker holding less text ("b")...
    assert policy.pick("x" * 10 + "z" * 90, [a, b]) is b
    b.in_flight = 3
    assert policy.pick("x" * 10 + "z" * 90, [a, b]) is a  # ...unless it is overloaded
    rr = RoundRobin()
    assert [rr.pick("k", [a, b]).url for _ in range(4)] == ["a", "b", "a", "b"]


def test_request_keys_share_prefixes_within_a_kind_and_salt():
    system = {"role": "system", "content": "You are a helpful assistant."}
    turn1 = request_keys.chat_key({"messages": [system, {"role": "user", "content": "Hi"}]})
    turn2 = request_keys.chat_key({"messages": [system, {"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello!"},
                                                {"role": "user", "content": "How are you?"}]})
    assert turn2.startswith(turn1)
    parts = request_keys.chat_key({"messages": [system, {"role": "user", "content": [{"type": "text",
                                                                                       "text": "Hi"}]}]})
    assert parts == turn1
    assert request_keys.generate_key({"text": "abc"}) == request_keys.completion_key({"prompt": "abc"})
    assert request_keys.generate_key({"text": ["abc", "def"]}) == request_keys.generate_key({"text": "abc"})
    salted = request_keys.generate_key({"text": "abc", "cache_salt": "tenant-1"})
    assert not salted.startswith(request_keys.generate_key({"text": "ab"}))
    # LoRA adapters never share KV on a worker, so their keys never share a prefix either.
    on_a = request_keys.generate_key({"text": "abc", "lora_path": "a"})
    assert on_a.startswith(request_keys.generate_key({"text": "ab", "lora_path": ["a", "b"]}))
    assert not on_a.startswith(request_keys.generate_key({"text": "ab", "lora_path": "b"}))
    assert not on_a.startswith(request_keys.generate_key({"text": "ab"}))
    assert request_keys.completion_key({"prompt": "abc", "model": "a"}) == on_a
    assert request_keys.generate_key({"input_ids": [5, 6, 7]}).startswith(
        request_keys.generate_key({"input_ids": [5, 6]}))
    assert request_keys.generate_key({"input_ids": "bad"}) is None and request_keys.chat_key("x") is None
    r1 = request_keys.responses_key({"instructions": "Be brief.", "input": "Hi"})
    assert r1.startswith(request_keys.chat_key({"messages": [{"role": "system", "content": "Be brief."}]}))


def test_metrics_merge_labels_every_sample_once_per_family():
    text = ('# HELP radixlm_requests_total Finished\n# TYPE radixlm_requests_total counter\n'
            'radixlm_requests_total{finish_reason="length"} 3.0\n'
            '# HELP radixlm_kv_usage KV\n# TYPE radixlm_kv_usage gauge\nradixlm_kv_usage 0.5\n')
    merged = merge_worker_metrics({"http://w1:1": text, "http://w2:2": text.replace("3.0", "4.0")})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = {(s.labels.get("worker"), s.labels.get("finish_reason")): s.value
               for s in families["radixlm_requests"].samples}
    assert samples == {("http://w1:1", "length"): 3.0, ("http://w2:2", "length"): 4.0}
    assert {s.labels["worker"] for s in families["radixlm_kv_usage"].samples} == {"http://w1:1", "http://w2:2"}
    assert merged.count("# TYPE radixlm_kv_usage") == 1


def test_router_cli_every_flag_has_a_help_with_its_default():
    from radixlm.srt.router.cli import build_parser

    parser = build_parser()
    assert all(a.help for a in parser._actions)
    text = parser.format_help()
    assert "--worker-urls" in text and "(default: cache_aware)" in text and "(default: 32)" in text


def test_router_caps_request_bodies_chunked_ones_too():
    import asyncio

    from radixlm.srt.router.app import create_router_app
    from radixlm.srt.router.policy import make_policy
    from radixlm.srt.router.proxy import Proxy
    from radixlm.srt.router.worker_metrics import RouterMetrics
    from radixlm.srt.router.workers import WorkerPool

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient() as upstream:
            pool = WorkerPool([f"127.0.0.1:{free_port()}"], upstream, {}, 1.0, 1.0)
            proxy = Proxy(pool, make_policy("cache_aware", 1000, 32, 0.5), upstream, RouterMetrics(), 5.0)
            app = create_router_app(pool, proxy, "cache_aware", None, max_request_bytes=100)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                async def chunks():
                    for _ in range(5):
                        yield b"x" * 50
                return await c.post("/generate", content=chunks()), await c.post("/generate", json={"text": "hi"})

    big, small = asyncio.run(run())
    assert big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"]
    assert small.status_code == 503 and small.json()["error"]["message"].startswith("no healthy workers")


# ---- a router without a model ---------------------------------------------------------------------

def test_router_without_workers_answers_503_naming_them_and_guards_the_key():
    dead_port = free_port()  # nothing listens there
    silent = socket.socket()  # accepts connections (the backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    router = RouterProcess("--worker-urls", f"127.0.0.1:{dead_port}", silent_url, "--health-timeout", "1",
                           "--health-interval", "0.5", env={"RADIXLM_API_KEY": KEY}, wait_for_workers=False)
    try:
        health = httpx.get(router.base_url + "/health", timeout=10)  # open without the key
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        assert f"http://127.0.0.1:{dead_port}" in message and "connection failed" in message
        assert silent_url in message and "did not answer within 1s" in message
        assert httpx.post(router.base_url + "/generate", json={"text": "hi"}, timeout=10).status_code == 401
        start = time.monotonic()
        r = httpx.post(router.base_url + "/generate", json={"text": "hi"}, headers=AUTH, timeout=10)
        assert r.status_code == 503 and time.monotonic() - start < 3
        assert r.json()["error"]["message"].startswith("no healthy workers") and silent_url in r.text
    finally:
        assert router.stop() == 0
        silent.close()


def test_dp_gpu_groups_and_too_few_gpus_fail_before_anything_starts(monkeypatch):
    from radixlm.srt.router.dp_launcher import gpu_groups
    from radixlm.srt.server_args import ServerArgs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_groups(ServerArgs(device="cuda", dp_size=2, tp_size=2)) == ["4,5", "6,7"]
    assert gpu_groups(ServerArgs(device="cpu", dp_size=2)) == [None, None]
    port = free_port()
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "radixlm.srt.launch", "--dp-size", "3", "--device", "cuda",
                          "--port", str(port)], env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and time.monotonic() - start < 60
    assert "--dp-size 3 x --tp-size 1 needs 3 GPUs; 2 visible (CUDA_VISIBLE_DEVICES=0,1)" in out.stderr
    assert "replica" not in out.stderr and "loading" not in out.stderr  # nothing started


# ---- two replicas: radixlm serve --dp-size 2 -------------------------------------------------------

@pytest.fixture(scope="module")
def dp():
    srv = ServerProcess("--dp-size", "2", "--max-total-tokens", "16384", api_key=KEY, startup_timeout=400)
    yield srv
    srv.stop()


def _worker_urls(dp: ServerProcess) -> list[str]:
    info = httpx.get(dp.base_url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert info["router"]["policy"] == "cache_aware"
    return [w["url"] for w in info["workers"]]


def _shared_prefix_prompts(groups: int = 4, per_group: int = 6, prefix_len: int = 128, suffix_len: int = 8):
    rng = random.Random(12)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(1000, 40000) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(1000, 40000) for _ in range(suffix_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def _cached_fraction(base_url: str, headers: dict[str, str], prompts: list[list[int]]) -> tuple[float, dict]:
    """Sends the prompts one after another (each server's cache state is then deterministic)."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        assert c.post("/flush_cache").status_code == 200
        cached = total = 0
        workers: dict[str, int] = {}
        for ids in prompts:
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1,
                                                                                "temperature": 0}})
            assert r.status_code == 200, r.text
            cached += r.json()["meta_info"]["cached_tokens"]
            total += r.json()["meta_info"]["prompt_tokens"]
            worker = r.headers.get("x-radixlm-worker", "single")
            workers[worker] = workers.get(worker, 0) + 1
    return cached / total, workers


def test_cache_aware_routing_keeps_prefixes_like_one_server_round_robin_does_not(dp, server):
    prompts = _shared_prefix_prompts()
    single, _ = _cached_fraction(server.base_url, {}, prompts)
    aware, aware_workers = _cached_fraction(dp.base_url, AUTH, prompts)
    rr_router = RouterProcess("--worker-urls", *_worker_urls(dp), "--policy", "round_robin",
                              env={"RADIXLM_API_KEY": KEY})
    try:
        rr, rr_workers = _cached_fraction(rr_router.base_url, AUTH, prompts)
    finally:
        rr_router.stop()
    print(f"cached-token fraction: single {single:.3f}, cache-aware {aware:.3f} {aware_workers}, "
          f"round-robin {rr:.3f} {rr_workers}")
    assert single > 0.7
    assert abs(aware - single) <= 0.10
    assert rr <= aware - 0.08
    assert len(aware_workers) == 2 and min(aware_workers.values()) >= 6  # both replicas served groups


def test_dp_serve_native_and_openai_routes(dp):
    from openai import OpenAI

    with httpx.Client(base_url=dp.base_url, timeout=120) as c:
        assert c.get("/health").status_code == 200  # open
        assert c.post("/generate", json={"text": "Hi"}).status_code == 401
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        whole = c.post("/generate", json=body, headers=AUTH)
        assert whole.status_code == 200 and whole.json()["meta_info"]["completion_tokens"] == 6
        with c.stream("POST", "/generate", json={**body, "stream": True}, headers=AUTH) as r:
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == whole.json()["text"]
    client = OpenAI(base_url=dp.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["default"]
    completion = client.completions.create(model="default", prompt="The capital of France is", max_tokens=6,
                                           temperature=0)
    assert completion.choices[0].text == whole.json()["text"]
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="default", messages=messages, max_tokens=8, temperature=0, stream=True) if chunk.choices)
    assert chat.choices[0].message.content and streamed == chat.choices[0].message.content
    response = client.responses.create(model="default", input="Say hello.", max_output_tokens=8)
    follow_up = client.responses.create(model="default", input="Again.", max_output_tokens=8,
                                        previous_response_id=response.id)  # only its maker stores it
    assert follow_up.output_text is not None
    assert client.responses.retrieve(response.id).id == response.id


def test_a_program_behind_the_router_keeps_and_ends_its_session(dp):
    import radixlm as sgl

    backend = sgl.RuntimeEndpoint(dp.base_url, api_key=KEY)
    assert backend.sessions  # the workers offer them, and the router passes /end_session on

    @sgl.function
    def prog(s):
        s += "Count: one two" + sgl.gen("a", max_tokens=2)
        s += " three" + sgl.gen("b", max_tokens=2)

    prog.run(backend=backend, temperature=0)
    with httpx.Client(base_url=dp.base_url, headers=AUTH, timeout=30) as c:
        workers = c.get("/get_server_info").json()["workers"]
        assert sum(w["info"]["sessions"]["ended"] for w in workers if w.get("info")) >= 1
        assert all(w["info"]["sessions"]["active"] == 0 for w in workers if w.get("info"))
        assert c.post("/end_session", json={"session_id": "never-used"}).json() == {"session_id": "never-used",
                                                                                  "ended": False}


def test_metrics_label_each_worker_and_bad_requests_pass_through(dp, server):
    urls = _worker_urls(dp)
    text = httpx.get(dp.base_url + "/metrics", headers=AUTH, timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["worker"] for s in families["radixlm_requests"].samples} == set(urls)
    assert {s.labels["worker"] for s in families["radixlm_router_requests"].samples} <= set(urls)
    assert families["radixlm_router_workers_healthy"].samples[0].value == 2
    assert "radixlm_router_retries" in families
    bad = {"text": "Hi", "sampling_params": {"temperature": -1}}
    through_router = httpx.post(dp.base_url + "/generate", json=bad, headers=AUTH, timeout=30)
    direct = httpx.post(server.base_url + "/generate", json=bad, timeout=30)
    assert through_router.status_code == direct.status_code == 400
    assert through_router.json() == direct.json()
    assert httpx.get(dp.base_url + "/metrics", headers=AUTH, timeout=30).text.count(
        "radixlm_router_retries_total 0.0") == 1  # a 400 is not retried


def _replica_pid(dp: ServerProcess, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in dp.children_pids():
        with open(f"/proc/{pid}/cmdline") as f:
            args = f.read().split("\0")
        if "--port" in args and args[args.index("--port") + 1] == port:
            return pid
    raise AssertionError(f"no replica on port {port}")


def _stream(base_url: str, prompt: str, started: threading.Event, out: dict) -> None:
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    with httpx.stream("POST", base_url + "/generate", json=body, headers=AUTH, timeout=120) as r:
        out["worker"], out["events"] = r.headers["x-radixlm-worker"], []
        for line in r.iter_lines():
            if line.startswith("data:"):
                out["events"].append(line[5:].strip())
                started.set()


def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(dp):
    urls = _worker_urls(dp)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        started = threading.Event()
        streams = [{} for _ in range(4)]
        stream_futures = [pool.submit(_stream, dp.base_url, f"Story number {i}:", started, out)
                          for i, out in enumerate(streams)]
        whole_futures = [pool.submit(httpx.post, dp.base_url + "/generate", headers=AUTH, timeout=120,
                                     json={"text": f"Question {i}: why is the sky blue?",
                                           "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}})
                         for i in range(6)]
        assert started.wait(120)
        victim = next(s["worker"] for s in streams if s.get("events"))
        os.kill(_replica_pid(dp, victim), signal.SIGKILL)
        wholes = [f.result(timeout=120) for f in whole_futures]
        for f in stream_futures:
            f.result(timeout=120)
    survivor = next(u for u in urls if u != victim)
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 32 for r in wholes), \
        [r.text for r in wholes]
    assert all(r.headers["x-radixlm-worker"] == survivor for r in wholes)  # retried ones finished there
    broken = 0
    for s in streams:
        last = [json.loads(e) for e in s["events"][:-1]][-1]
        assert s["events"][-1] == "[DONE]"
        if "error" in last:  # started on the victim: ends with an error event naming it
            assert s["worker"] == victim and victim in last["error"]["message"]
            broken += 1
        else:
            assert last["meta_info"]["completion_tokens"] == 48
    assert broken >= 1
    metrics = httpx.get(dp.base_url + "/metrics", headers=AUTH, timeout=30).text
    retries = next(f for f in text_string_to_metric_families(metrics) if f.name == "radixlm_router_retries")
    assert retries.samples[0].value >= 1
    assert httpx.get(dp.base_url + "/health", timeout=10).status_code == 200
    again = httpx.post(dp.base_url + "/generate", headers=AUTH, timeout=60,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert again.status_code == 200 and again.headers["x-radixlm-worker"] == survivor
    # The last replica gone: 503 naming the workers, then the command exits 1.
    os.kill(_replica_pid(dp, survivor), signal.SIGKILL)

    def unhealthy() -> httpx.Response | None:
        health = httpx.get(dp.base_url + "/health", timeout=10)
        return health if health.status_code != 200 else None

    health = wait_until(unhealthy, 10)
    assert health is not None, "still healthy 10 s after the last replica died"
    assert health.status_code == 503
    assert "no healthy workers" in health.json()["error"]["message"] and victim in health.text
    assert dp.proc.wait(30) == 1

