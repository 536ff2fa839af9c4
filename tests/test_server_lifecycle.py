"""Process lifecycle, API keys and KV pressure, each on a server of its own."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from benchmarks.harness import ServerProcess, pid_alive, wait_until


@pytest.fixture(scope="module")
def small_server():
    """Little KV (400 slots) and an API key: queueing, retraction and auth are all exercised."""
    srv = ServerProcess("--max-total-tokens", "400", "--max-running-requests", "8",
                        "--chunked-prefill-size", "64", api_key="test-secret")
    yield srv
    srv.stop()


def test_api_key_required_except_health(small_server):
    url = small_server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(f"{url}/generate", json=body).status_code == 401
    wrong = httpx.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert httpx.get(f"{url}/get_server_info").status_code == 401
    with small_server.client() as c:
        assert c.post("/generate", json=body).status_code == 200


def test_more_work_than_kv_completes_through_queueing_and_retraction(small_server):
    """8 requests need ~8 x 80 tokens of KV but only 400 slots exist; greedy outputs must equal
    each request run alone."""
    prompts = [f"Request {i}: list the numbers from one to forty in words, separated by commas:" for i in range(8)]
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    with small_server.client(timeout=600) as c:
        solo = [c.post("/generate", json={"text": p, "sampling_params": params}).json()["output_ids"] for p in prompts[:2]]

    async def run():
        async with httpx.AsyncClient(base_url=small_server.base_url, headers=small_server.headers(), timeout=600) as c:
            return await asyncio.gather(*(c.post("/generate", json={"text": p, "sampling_params": params})
                                          for p in prompts))

    results = [r.json() for r in asyncio.run(run())]
    assert all(r["meta_info"]["completion_tokens"] == 60 for r in results)
    assert [r["output_ids"] for r in results[:2]] == solo
    with small_server.client() as c:
        kv = c.get("/get_server_info").json()["kv"]
    assert kv["leaked"] == 0 and kv["protected"] == 0
    assert "retracted" in small_server.log()


def test_sigterm_stops_children_and_removes_sockets(default_model):
    # A tokenizer directory: the main process reads it while the children start.
    srv = ServerProcess("--max-total-tokens", "1024", "--tokenizer-path", str(default_model.local_dir))
    with srv.client() as c:
        out = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 2
    children = srv.children_pids()
    ipc_dir = re.search(r"ipc directory: (\S+)", srv.log()).group(1)
    assert os.path.isdir(ipc_dir) and os.stat(ipc_dir).st_mode & 0o777 == 0o700
    assert srv.stop(signal.SIGTERM) == 0
    assert not os.path.exists(ipc_dir)
    # multiprocessing's resource tracker exits when it reads EOF from the dead server, a moment
    # after the server itself: allow it that moment, but nothing may outlive it.
    wait_until(lambda: not any(pid_alive(p) for p in children), 10)
    assert children and not any(pid_alive(p) for p in children)


def test_dead_child_makes_server_unhealthy_and_exit_nonzero():
    srv = ServerProcess("--max-total-tokens", "1024")
    children = srv.children_pids()
    os.kill(children[-1], signal.SIGKILL)
    saw_unhealthy = False

    def exited_after_a_health_check() -> bool:
        nonlocal saw_unhealthy
        try:
            saw_unhealthy |= httpx.get(f"{srv.base_url}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        return srv.proc.poll() is not None

    wait_until(exited_after_a_health_check, 30, interval=0.2)
    assert srv.proc.wait(30) != 0
    assert saw_unhealthy
    wait_until(lambda: not any(pid_alive(p) for p in children), 2)
    assert not any(pid_alive(p) for p in children)
    srv.stop()
