"""Bad input, floods and tenants against real servers (issue 15): every bad request gets its
400/413/429 naming the problem, never a 500, and leaves nothing behind (no poisoned rid, no
leaked KV slot); the API key guards every route but /health; the OpenAPI document is usable."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from radixlm.srt.intake import Intake
from benchmarks.harness import ServerProcess, wait_until

BIG = 2**64


# ---- the shared server: bad input ----------------------------------------------------------------

@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"text": "hi", "sampling_params": {"top_k": BIG - 1}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": BIG - 1}}, "sampling_params.min_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2, "seed": BIG - 1}}, "sampling_params.seed"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2, "seed": "x"}}, "sampling_params.seed"),
    ("/generate", {"text": "hi", "rid": {"a": 1}}, "rid"),
    ("/generate", {"text": "hi", "rid": []}, "rid"),
    ("/generate", {"text": True, "input_ids": [[1]]}, "text"),
    ("/generate", {"text": ["a", "b"], "rid": ["r1"]}, "rid"),  # was 200 with one result
    ("/generate", {"text": "hi", "stream": "no"}, "stream"),  # was streamed
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": BIG}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": BIG - 1}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": BIG - 1}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": BIG - 1},
     "top_k"),
])
def test_bad_input_is_400_naming_the_field_and_poisons_nothing(server, path, body, field):
    rid = f"leakme-{abs(hash((path, str(body)))) % 10**8}"
    if path == "/generate" and "rid" not in body:
        body = {**body, "rid": rid}
    with server.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(field) and err["code"] == "invalid_request"
        # The rid it carried is free: nothing was registered before the request was refused.
        ok = c.post("/generate", json={"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200, ok.text


def test_native_and_openai_errors_agree_on_code(server):
    with server.client() as c:
        native = c.post("/generate", content=b"{oops").json()["error"]
        openai = c.post("/v1/completions", content=b"{oops").json()["error"]
    assert native["code"] == openai["code"] == "invalid_request"
    assert native["type"] == openai["type"] == "invalid_request_error"


def test_max_new_tokens_is_clamped_to_the_context_left():
    class Chars:
        def encode(self, text, add_special_tokens=False):
            return [7] * len(text)

    intake = Intake(Chars(), vocab_size=100, context_len=64)
    [msg] = intake.samples(intake.prompt_ids("0123456789"), {"max_new_tokens": 10**9})
    assert msg.sampling_params.max_new_tokens == 54


def test_a_huge_max_new_tokens_does_not_stall_others(server):
    """The trial's request: 10**9 tokens, streamed, ignore_eos. A 4-token request beside it
    must finish in seconds, not time out."""
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 10**9, "ignore_eos": True}}
    with server.client() as c, c.stream("POST", "/generate", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        started = time.monotonic()
        small = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                            "ignore_eos": True}})
        assert small.status_code == 200 and small.json()["meta_info"]["completion_tokens"] == 4
        assert time.monotonic() - started < 30
    _assert_no_leak(server)


def test_abort_all_must_be_explicit_and_needs_an_api_key(server):
    with server.client() as c:
        r = c.post("/abort_request", json={"rid": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
        r = c.post("/abort_request", json={"abort_all": True})  # this server has no API key
        assert r.status_code == 403 and r.json()["error"]["param"] == "abort_all"
        r = c.post("/abort_request", json={"abort_all": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "abort_all"


def test_openapi_declares_bodies_and_unique_operation_ids(server):
    with server.client() as c:
        doc = c.get("/openapi.json").json()
    ops = [(path, method, op) for path, methods in doc["paths"].items() for method, op in methods.items()]
    ids = [op["operationId"] for _, _, op in ops]
    assert len(ids) == len(set(ids))
    posts = {path for path, method, _ in ops if method == "post"}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/abort_request"} <= posts
    for path, method, op in ops:
        if method in ("post", "put") and path != "/flush_cache":
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.split("/")[-1] in doc["components"]["schemas"], path
    generate = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    assert {"text", "input_ids", "sampling_params", "stream", "rid", "cache_salt", "lora_path"} <= set(generate)


def test_body_over_the_cap_is_413(server):
    with server.client() as c:
        r = c.post("/generate", content=b"x" * (8 * 2**20 + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_a_long_prompt_does_not_block_the_event_loop(server):
    """A few MB of text take seconds to tokenize; /health must answer meanwhile."""
    text = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB, too long for the context: 400 at the end
    result = {}

    def post() -> None:
        with server.client() as c:
            result["status"] = c.post("/generate", json={"text": text}).status_code

    worker = threading.Thread(target=post)
    worker.start()
    slowest = 0.0
    while worker.is_alive():  # from the upload on, through tokenizing, to the answer
        started = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.1)
    worker.join()
    assert result["status"] == 400
    assert slowest < 1.0


def _assert_no_leak(srv: ServerProcess) -> None:
    with srv.client() as c:
        def idle() -> bool:
            info = c.get("/get_server_info").json()
            return info["num_running_reqs"] == info["num_waiting_reqs"] == 0

        wait_until(idle, 10, interval=0.2)
        info = c.get("/get_server_info").json()
    assert info["kv"]["leaked"] == 0 and info["kv"]["protected"] == 0


# ---- the CLI ----------------------------------------------------------------------------------------

def test_cli_help_exits_0_and_every_flag_has_a_help_with_its_default():
    top = subprocess.run([sys.executable, "-c", "from radixlm.srt.launch import cli; cli()", "--help"],
                         capture_output=True, text=True)
    assert top.returncode == 0 and "serve" in top.stdout
    from radixlm.srt.server_flags import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.option_strings == ["-h", "--help"]:
            continue
        assert action.help, action.option_strings
    text = parser.format_help()
    assert "(default: 256)" in text and "--max-queued-requests" in text and "--graceful-shutdown-timeout" in text


# ---- a server with an API key (from the environment) and a small queue ----------------------------

KEY = "robust-secret"


@pytest.fixture(scope="module")
def guarded():
    srv = ServerProcess("--max-total-tokens", "4096", "--max-running-requests", "1", "--max-queued-requests", "1",
                        api_key=KEY, env={"RADIXLM_API_KEY": KEY})
    yield srv
    srv.stop()


def test_api_key_from_the_environment_stays_off_the_command_line(guarded):
    with open(f"/proc/{guarded.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    assert "warmed up" in guarded.log()  # /health said 200 only after the warm-up request


def test_every_route_but_health_needs_the_key(guarded):
    with guarded.client() as c:
        doc = c.get("/openapi.json").json()
    assert httpx.get(f"{guarded.base_url}/openapi.json").status_code == 401
    checked = 0
    for path, methods in doc["paths"].items():
        concrete = path.replace("{model_id}", "default").replace("{response_id}", "resp_x")
        for method in methods:
            r = httpx.request(method.upper(), guarded.base_url + concrete, json={})
            if path == "/health":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
            checked += 1
    assert checked >= 15
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    for header in (f"bearer {KEY}", f"Bearer {KEY}", f"BEARER  {KEY}"):
        assert httpx.post(f"{guarded.base_url}/generate", json=body, headers={"Authorization": header}).status_code == 200
    for header in (KEY, f"Basic {KEY}", "Bearer wrong", "Bearer"):
        assert httpx.post(f"{guarded.base_url}/generate", json=body, headers={"Authorization": header}).status_code == 401


def test_queue_beyond_the_limit_is_429_with_retry_after_and_counted(guarded):
    slow = {"text": "Count to fifty:", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}

    async def flood():
        async with httpx.AsyncClient(base_url=guarded.base_url, headers=guarded.headers(), timeout=120) as c:
            return await asyncio.gather(*(c.post("/generate", json=slow) for _ in range(5)))

    replies = asyncio.run(flood())
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "too_many_requests"
    with guarded.client() as c:
        batch = c.post("/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1}})
        assert batch.status_code == 429  # a batch is admitted whole or not at all
        metrics = c.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('radixlm_rejected_requests_total{reason="queue_full"}'))
    assert float(line.split()[-1]) >= 2
    _assert_no_leak(guarded)


def test_abort_all_with_the_key_ends_every_request(guarded):
    body = {"text": "Tell a long story.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}

    async def run():
        async with httpx.AsyncClient(base_url=guarded.base_url, headers=guarded.headers(), timeout=120) as c:
            async def decoding() -> None:  # abort_all must end a request that is running
                while (await c.get("/get_server_info")).json()["num_running_reqs"] < 1:
                    await asyncio.sleep(0.05)

            running = asyncio.ensure_future(c.post("/generate", json=body))
            await asyncio.wait_for(decoding(), 60)
            assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
            return await running

    reply = asyncio.run(run())
    assert reply.status_code == 200 and reply.json()["meta_info"]["finish_reason"]["type"] == "abort"
    _assert_no_leak(guarded)
    assert os.path.exists(f"/proc/{guarded.proc.pid}")


# ---- per-client rate limit (the guard alone: no model needed) -------------------------------------

def test_rate_limit_per_api_key_is_429_with_retry_after_and_counted():
    from radixlm.srt.server.guard import Guard, RateLimiter
    from radixlm.srt.server.metrics import Metrics

    class State:
        serving, not_serving_reason = True, ""

        class tm:  # noqa: N801  (stands in for the TokenizerManager)
            metrics = Metrics()

            @staticmethod
            def is_full(adding: int = 1) -> bool:
                return False

    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = Guard(ok_app, State, api_key=None, max_request_bytes=1024, rate_limit_rpm=2)

    async def run():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            alice = [await c.post("/generate", json={}, headers={"Authorization": "Bearer alice"}) for _ in range(2)]
            alice.append(await c.put("/generate", json={}, headers={"Authorization": "Bearer alice"}))  # PUT too
            bob = await c.post("/v1/completions", json={}, headers={"Authorization": "Bearer bob"})
            other_route = await c.post("/tokenize", json={}, headers={"Authorization": "Bearer alice"})
            return alice, bob, other_route

    alice, bob, other_route = asyncio.run(run())
    assert [r.status_code for r in alice] == [200, 200, 429]
    assert 1 <= int(alice[2].headers["retry-after"]) <= 60 and "--rate-limit-rpm" in alice[2].json()["error"]["message"]
    assert bob.status_code == 200 and other_route.status_code == 200  # per client, generation routes only
    assert 'reason="rate_limited"} 1.0' in State.tm.metrics.render().decode()
    limiter = RateLimiter(1)
    assert limiter.wait_s(b"k", now=0.0) == 0 and limiter.wait_s(b"k", now=30.0) == 30.0
    assert limiter.wait_s(b"k", now=60.0) == 0  # the window slid past the first request
