"""Every generation route runs its requests one way (srt/server/request_runner.py): a batch or
n > 1 request is admitted whole or refused whole, a client that leaves frees its KV at once,
and a streamed answer is the whole answer cut into pieces; against real servers."""

from __future__ import annotations

import json
import math
import socket
import time

import httpx
import openai
import pytest

from benchmarks.harness import ServerProcess

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 12}


def _metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of a counter's samples (those whose labels contain `label`) in /metrics text."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


# ---- admission: whole or nothing ------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    """A server that holds at most two requests (one running, one waiting)."""
    srv = ServerProcess("--max-total-tokens", "4096", "--max-running-requests", "1", "--max-queued-requests", "1")
    yield srv
    srv.stop()


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 3}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 3}),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 1, "n": 3}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 1, "n": 3, "stream": True}),
])
def test_a_request_over_the_queue_limit_is_refused_whole(small, path, body):
    with small.client() as c:
        before = c.get("/metrics").text
        r = c.post(path, json=body)
        after = c.get("/metrics").text
    assert r.status_code == 429 and r.headers["retry-after"] == "1"  # a status, also for a stream
    assert r.json()["error"]["code"] == "too_many_requests" and "--max-queued-requests" in r.json()["error"]["message"]
    assert _metric_sum(after, "radixlm_rejected_requests_total", "queue_full") == \
        _metric_sum(before, "radixlm_rejected_requests_total", "queue_full") + 1
    # Nothing of it ran: no request ended (an aborted one would count too).
    assert _metric_sum(after, "radixlm_requests_total") == _metric_sum(before, "radixlm_requests_total")


def test_a_request_at_the_queue_limit_runs_whole(small):
    client = openai.OpenAI(base_url=f"{small.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="default", messages=FRANCE, max_tokens=2, n=2, seed=3)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 4
    with small.client() as c:
        native = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert native.status_code == 200 and [o["meta_info"]["completion_tokens"] for o in native.json()] == [2, 2]


# ---- a client that leaves -----------------------------------------------------------------------------

def _server_info(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "Tell a long story.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}),
    ("/v1/completions", {"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2000, "ignore_eos": True, "n": 2}),
])
def test_a_client_leaving_a_request_not_streamed_frees_its_kv_at_once(server, path, body):
    """2000 tokens take minutes here; the request must end when its client hangs up, not then."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 60
    while _server_info(server)["num_running_reqs"] == 0:  # it decodes, holding KV
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    assert _server_info(server)["kv"]["held_by_requests"] > 0
    sock.close()
    left = time.monotonic()
    while True:
        info = _server_info(server)
        if info["num_running_reqs"] == info["num_waiting_reqs"] == 0 and info["num_active_requests_main"] == 0:
            break
        assert time.monotonic() - left < 10, f"still running after its client left: {info}"
        time.sleep(0.05)
    kv = info["kv"]
    assert kv["held_by_requests"] == 0 and kv["leaked"] == 0 and kv["protected"] == 0


# ---- streamed = the whole answer in pieces --------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _close(a: list[float | None], b: list[float | None]) -> bool:
    """Logprobs of the same tokens in two runs (a cached prefix may shift the last digits)."""
    return len(a) == len(b) and all((x is None and y is None) or math.isclose(x, y, abs_tol=1e-4)
                                    for x, y in zip(a, b))


def test_native_stream_chunks_grow_to_the_whole_answer_with_logprobs(server):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 12},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    with server.client() as c:
        whole = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) > 2
    last, meta = chunks[-1], whole["meta_info"]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    for name in ("input_token_logprobs", "output_token_logprobs"):
        got = last["meta_info"][name]
        assert [t[1:] for t in got] == [t[1:] for t in meta[name]]  # ids and texts
        assert _close([t[0] for t in got], [t[0] for t in meta[name]])
    assert [[t[1:] for t in top] for top in last["meta_info"]["output_top_logprobs"]] == \
        [[t[1:] for t in top] for top in meta["output_top_logprobs"]]
    for a, b in zip(chunks, chunks[1:]):  # each chunk holds everything so far
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert b["meta_info"]["output_token_logprobs"][:len(a["output_ids"])] == a["meta_info"]["output_token_logprobs"]
        assert len(a["meta_info"]["output_token_logprobs"]) == len(a["output_ids"])


def test_completion_stream_pieces_make_the_whole_answer_with_logprobs(client):
    kwargs = dict(model="default", prompt="Once upon a time", logprobs=2, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    pieces = [c.logprobs for c in chunks if c.logprobs and c.logprobs.tokens]
    assert len(pieces) > 2
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for p in pieces for t in p.tokens] == whole.logprobs.tokens
    assert [o for p in pieces for o in p.text_offset] == whole.logprobs.text_offset
    assert _close([lp for p in pieces for lp in p.token_logprobs], whole.logprobs.token_logprobs)
    assert [sorted(top) for p in pieces for top in p.top_logprobs] == [sorted(top) for top in whole.logprobs.top_logprobs]


def test_chat_stream_pieces_make_the_whole_answer_with_logprobs(client):
    kwargs = dict(model="default", messages=FRANCE, logprobs=True, top_logprobs=2, **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    items = [t for c in chunks if c.logprobs for t in c.logprobs.content]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert [t.token for t in items] == [t.token for t in whole.logprobs.content]
    assert _close([t.logprob for t in items], [t.logprob for t in whole.logprobs.content])
    assert [[a.token for a in t.top_logprobs] for t in items] == \
        [[a.token for a in t.top_logprobs] for t in whole.logprobs.content]
    assert [c.finish_reason for c in chunks if c.finish_reason] == [whole.finish_reason]


def test_responses_stream_pieces_make_the_whole_answer(client):
    kwargs = dict(model="default", input="What is the capital of France?", temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == whole.output_text
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == whole.output_text
    assert completed.response.usage.output_tokens == whole.usage.output_tokens
