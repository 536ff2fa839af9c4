"""Faults against real server processes (issue 15): a child killed mid-request, SIGTERM with
requests running, Ctrl-C, kill -9 of the main process, a busy port. Each needs a server of its
own, since each ends it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.harness import ServerProcess, pid_alive, wait_until

LONG = {"max_new_tokens": 4000, "ignore_eos": True}


async def _first_event_then_rest(client: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event) -> list[str]:
    """A stream's data lines: signals `started` after the first, then reads to the end."""
    lines = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                lines.append(line[5:].strip())
                started.set()
    return lines


def _final_error(lines: list[str]) -> dict:
    events = [json.loads(x) for x in lines if x != "[DONE]"]
    assert events and "error" in events[-1], lines[-3:]
    return events[-1]["error"]


async def _until_active(c: httpx.AsyncClient, count: int, timeout: float = 120) -> None:
    """Returns once the server holds `count` requests (its tokenizer manager's count)."""
    async def poll() -> None:
        while (await c.get("/get_server_info")).json()["num_active_requests_main"] < count:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout)


async def _health_once_handled(c: httpx.AsyncClient, within: float) -> httpx.Response:
    """The first /health answer that is not 200 (the server has handled a signal), or the last
    one `within` seconds on."""
    deadline = time.monotonic() + within
    while (health := await c.get("/health")).status_code == 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return health


async def _requests_in_flight(srv: ServerProcess, act) -> tuple[list[str], httpx.Response, list[str], float]:
    """A native stream, a native whole request and an OpenAI stream under way; `act()` runs once
    all three are running. Returns their outcomes and how long after `act` the last one ended."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as c:
        s1, s2 = asyncio.Event(), asyncio.Event()
        native = asyncio.ensure_future(_first_event_then_rest(
            c, "/generate", {"text": "Tell a long story.", "stream": True, "sampling_params": LONG}, s1))
        openai = asyncio.ensure_future(_first_event_then_rest(
            c, "/v1/completions", {"prompt": "Once", "stream": True, "max_tokens": 4000, "ignore_eos": True}, s2))
        whole = asyncio.ensure_future(c.post("/generate", json={"text": "Go on.", "sampling_params": LONG}))
        await asyncio.wait_for(asyncio.gather(s1.wait(), s2.wait()), 120)
        await _until_active(c, 3)  # the whole request too
        acted = time.monotonic()
        act()
        results = await asyncio.wait_for(asyncio.gather(native, whole, openai), 60)
        return (*results, time.monotonic() - acted)


@pytest.mark.parametrize("child", ["scheduler", "detokenizer"])
def test_killed_child_fails_requests_in_flight_at_once(child):
    srv = ServerProcess("--max-total-tokens", "8192")
    try:
        pids = {name: int(pid) for name, pid in re.findall(r"(\w+) pid (\d+)", srv.log())}
        ipc_dir = re.search(r"ipc directory: (\S+)", srv.log()).group(1)
        native, whole, openai, took = asyncio.run(_requests_in_flight(srv, lambda: os.kill(pids[child], signal.SIGKILL)))
        assert took < 3.0  # not the 5 s graceful timeout, let alone a request's whole run
        assert whole.status_code == 503 and whole.headers["content-type"] == "application/json"
        assert "died" in whole.json()["error"]["message"] and whole.json()["error"]["code"] == "server_unavailable"
        assert "died" in _final_error(native)["message"]
        assert "died" in _final_error(openai)["message"] and openai[-1] == "[DONE]"
        assert srv.proc.wait(30) == 1
        assert not os.path.exists(ipc_dir)
    finally:
        srv.stop()


def _children_of(srv: ServerProcess) -> list[int]:
    children = srv.children_pids()
    assert len(children) >= 2
    return children


def test_sigterm_drains_finishes_short_requests_and_fails_the_rest():
    srv = ServerProcess("--max-total-tokens", "8192", "--graceful-shutdown-timeout", "6")

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as c:
            started = asyncio.Event()
            long_stream = asyncio.ensure_future(_first_event_then_rest(
                c, "/generate", {"text": "Tell a long story.", "stream": True, "sampling_params": LONG}, started))
            await asyncio.wait_for(started.wait(), 120)
            short = asyncio.ensure_future(c.post("/generate", json={
                "text": "Hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
            await _until_active(c, 2)  # both are in the server before it is told to stop
            srv.proc.send_signal(signal.SIGTERM)
            health = await _health_once_handled(c, within=0.5)
            refused = await c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
            return health, refused, await short, await long_stream

    children = _children_of(srv)
    health, refused, short, long_lines = asyncio.run(run())
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    assert refused.status_code == 503
    assert short.status_code == 200 and short.json()["meta_info"]["completion_tokens"] == 4
    assert "shutting down" in _final_error(long_lines)["message"] and long_lines[-1] == "[DONE]"
    assert srv.proc.wait(30) == 0
    wait_until(lambda: not any(pid_alive(p) for p in children), 1)
    assert not any(pid_alive(p) for p in children)
    assert "Traceback" not in srv.log()
    srv.stop()


def test_ctrl_c_is_quiet_and_ends_streams_with_an_error_event():
    srv = ServerProcess("--max-total-tokens", "8192", own_group=True)
    children = _children_of(srv)
    # A terminal's Ctrl-C: SIGINT to the whole process group, children included.
    native, whole, openai, took = asyncio.run(_requests_in_flight(srv, lambda: os.killpg(srv.proc.pid, signal.SIGINT)))
    assert took < 5.0
    assert "shutting down" in _final_error(native)["message"]
    assert "shutting down" in _final_error(openai)["message"]
    assert whole.status_code == 503
    assert srv.proc.wait(30) == 0
    wait_until(lambda: not any(pid_alive(p) for p in children), 1)
    assert not any(pid_alive(p) for p in children)
    log = srv.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    srv.stop()


def test_kill_9_of_the_main_process_leaves_no_children_and_no_ipc_directory():
    srv = ServerProcess("--max-total-tokens", "1024")
    children = _children_of(srv)
    ipc_dir = re.search(r"ipc directory: (\S+)", srv.log()).group(1)
    srv.proc.kill()
    srv.proc.wait()
    wait_until(lambda: not os.path.exists(ipc_dir) and not any(pid_alive(p) for p in children), 15)
    assert not os.path.exists(ipc_dir)
    assert not any(pid_alive(p) for p in children)
    srv.stop()


def test_busy_port_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "radixlm.srt.launch", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "loading" not in proc.stderr and took < 15
