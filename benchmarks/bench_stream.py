"""Per-chunk server time of a long stream, at its start and at its end (issue 31, point 3).

A stream of 8000 tokens with logprobs and 5 top alternatives each, on /generate,
/v1/completions and /v1/chat/completions. The model cannot decode that many tokens quickly on
a CPU, so a scripted peer process stands in for the scheduler and the detokenizer: it answers
each request over the real ZeroMQ sockets with one token per message (its text, logprob and
top-5 entries), and sends the next token only once the client, in the same process, has read
the previous token's SSE event. Everything between those sockets and the HTTP socket is the
real front end, in this process: TokenizerManager, the route code, FastAPI and uvicorn.

Per chunk it measures, in this process, the CPU time spent from one SSE event handed to the
ASGI server to the next (the message's arrival, decoding, the tokenizer manager, the route,
the previous event's write), and the wall time from the peer's send to the event leaving the
route. Since nothing else runs here and the peer waits for each event, that is the server's
work per chunk. The baseline is the start of the same stream: a stream whose chunks cost the
same at its end as at its start has end / start near 1 (goal: <= 1.5).

/generate's events hold everything so far (SGLang's default, which clients rely on), so its
events grow with the stream, logprobs most: `--routes "/generate without logprobs"` measures
the same stream with the text and ids only, and `--incremental-streaming-output` with the
server setting that makes each /generate event hold only what is new.

    python -m benchmarks.bench_stream [--tokens 8000] [--out benchmarks/results/cpu_stream.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .harness import Reporter, command_line, free_port, ratio

GOAL = 1.5
WINDOW = 200  # chunks in each of the start and end medians
TOP_K = 5
PROMPT = "Tell a long story."


@dataclass(frozen=True)
class Case:
    path: str
    body: dict[str, Any]
    events_before_tokens: int = 0  # SSE events before the first token's (the chat stream opens with the role)

    def request(self, tokens: int) -> dict[str, Any]:
        body = json.loads(json.dumps(self.body))
        if self.path == "/generate":
            body["sampling_params"]["max_new_tokens"] = tokens
        else:
            body["max_tokens"] = tokens
        return body


NATIVE = {"text": PROMPT, "stream": True, "sampling_params": {"ignore_eos": True}}
CASES = {
    "/generate": Case("/generate", {**NATIVE, "return_logprob": True, "top_logprobs_num": TOP_K,
                                    "return_text_in_logprobs": True}),
    "/v1/completions": Case("/v1/completions", {"model": "bench", "prompt": PROMPT, "stream": True,
                                                "logprobs": TOP_K}),
    "/v1/chat/completions": Case("/v1/chat/completions", {
        "model": "bench", "messages": [{"role": "user", "content": PROMPT}], "stream": True, "logprobs": True,
        "top_logprobs": TOP_K}, events_before_tokens=1),
    # Not in the default set: /generate without logprobs, whose events hold only the text and ids so far.
    "/generate without logprobs": Case("/generate", NATIVE),
}
DEFAULT_CASES = ["/generate", "/v1/completions", "/v1/chat/completions"]


def _token_message(io_struct: Any, rid: str, k: int, tokens: int, prompt_len: int, rng: random.Random) -> bytes:
    token = rng.randrange(1000, 40000)
    lp = -rng.random() * 3
    top = [[lp, token]] + [[lp - rng.random() * 2 - 0.01 * i, rng.randrange(1000, 40000)] for i in range(TOP_K - 1)]
    last = k == tokens - 1
    out = io_struct.ReqOutput(
        rid=rid, new_token_ids=[token], finish_reason={"type": "length", "matched": None} if last else None,
        prompt_tokens=prompt_len, completion_tokens=k + 1, cached_tokens=0,
        input_token_logprobs=[], input_top_logprobs=[], output_token_logprobs=[[lp, token]],
        output_top_logprobs=[top])
    return io_struct.encode(io_struct.BatchTextOut([io_struct.ReqTextOutput(rid, " tok", out)]))


class _Events:
    """Counts SSE events on a streamed HTTP response as its bytes arrive."""

    def __init__(self, response: Any):
        self._raw = response.iter_raw()
        self._tail = b""
        self.count = 0
        self.done = False

    def wait_for(self, count: int) -> None:
        while self.count < count and not self.done:
            try:
                data = self._tail + next(self._raw)
            except StopIteration:
                self.done = True
                return
            self.count += data.count(b"\n\n")
            # An event's closing blank line may be split between two reads.
            self._tail = b"\n" if data.endswith(b"\n") and not data.endswith(b"\n\n") else b""


def drive(port: int, scheduler_addr: str, tm_addr: str, tokens: int, conn: Any) -> None:
    """The peer and the client: per route, one streamed request answered token by token."""
    import httpx
    import zmq
    from radixlm.srt import io_struct

    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.bind(scheduler_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(tm_addr)
    rng = random.Random(0)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        while (name := conn.recv()) is not None:
            case, sent_ns = CASES[name], []
            with client.stream("POST", case.path, json=case.request(tokens)) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: {response.status_code} {response.read()[:500]!r}")
                events = _Events(response)
                before = case.events_before_tokens
                events.wait_for(before)
                msg = io_struct.decode(requests.recv())
                for k in range(tokens):
                    payload = _token_message(io_struct, msg.rid, k, tokens, len(msg.input_ids), rng)
                    sent_ns.append(time.perf_counter_ns())
                    outputs.send(payload)
                    events.wait_for(before + k + 1)
                events.wait_for(10**9)  # the rest: the final events and [DONE]
            conn.send(sent_ns)
    requests.close()
    outputs.close()
    ctx.term()


# ---- the front end (this process) ----------------------------------------------------------------

class ChunkProbe:
    """ASGI middleware: when each response body chunk leaves the app, the time, this process's
    CPU time and the chunk's size, per request path."""

    def __init__(self, app: Any):
        self.app = app
        self.records: dict[str, list[tuple[int, int, int]]] = defaultdict(list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        log = self.records[scope["path"]]

        async def probed_send(message: Any) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                log.append((time.perf_counter_ns(), time.process_time_ns(), len(message["body"])))
            await send(message)

        await self.app(scope, receive, probed_send)


def _median_us(values: list[int]) -> float:
    return round(statistics.median(values) / 1000, 1)


def _figures(name: str, records: list[tuple[int, int, int]], sent_ns: list[int], tokens: int) -> dict[str, Any]:
    first = CASES[name].events_before_tokens
    chunks = records[first:first + tokens]  # chunk k carries token k
    if len(chunks) != tokens:
        raise RuntimeError(f"{name}: {len(chunks)} token events for {tokens} tokens")
    cpu = [chunks[k][1] - chunks[k - 1][1] for k in range(1, tokens)]
    wall = [chunks[k][0] - sent_ns[k] for k in range(tokens)]
    window = min(WINDOW, tokens // 4)
    start, end = _median_us(cpu[:window]), _median_us(cpu[-window:])
    return {"route": name, "start_us": start, "end_us": end, "ratio": ratio(end, start), "goal": GOAL,
            "met": end / start <= GOAL, "wall_start_us": _median_us(wall[:window]),
            "wall_end_us": _median_us(wall[-window:]), "last_chunk_bytes": chunks[-1][2]}


def measure(tokens: int, cases: list[str], incremental: bool = False) -> list[dict[str, Any]]:
    """Per-chunk figures of one stream of `tokens` tokens for each case (a name in CASES), on a
    front end whose /generate streams are incremental (--incremental-streaming-output) or not."""
    return asyncio.run(_serve_and_measure(tokens, cases, incremental))


async def _serve_and_measure(tokens: int, routes: list[str], incremental: bool) -> list[dict[str, Any]]:
    import uvicorn
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.srt.server.http_server import ServerState, create_app
    from radixlm.srt.server.openai_api import register_openai_routes
    from radixlm.srt.server.tokenizer_manager import TokenizerManager

    importlib.import_module("xgrammar")  # the tokenizer manager imports it in a thread: not while measuring
    meta = load_model(with_weights=False)
    ipc_dir = tempfile.mkdtemp(prefix="bench-stream-")
    scheduler_addr, tm_addr = f"ipc://{ipc_dir}/scheduler", f"ipc://{ipc_dir}/tokenizer"
    tm = TokenizerManager(meta.tokenizer, meta.config, meta.config.context_len, scheduler_addr, tm_addr)
    state = ServerState(tm, "bench", {})
    app = create_app(state, api_key=None, incremental_streaming_output=incremental)
    register_openai_routes(app, lambda: tm, "bench")
    probe = ChunkProbe(app)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(probe, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    tm.start()
    ours, theirs = mp.get_context("spawn").Pipe()
    driver = mp.get_context("spawn").Process(target=drive, args=(port, scheduler_addr, tm_addr, tokens, theirs))
    driver.start()
    results = []
    try:
        for name in routes:
            ours.send(name)
            sent_ns = await asyncio.to_thread(ours.recv)
            figures = _figures(name, probe.records.pop(CASES[name].path), sent_ns, tokens)
            if incremental and CASES[name].path == "/generate":
                figures["route"] += " --incremental-streaming-output"
            results.append(figures)
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        ours.send(None)
        await asyncio.to_thread(driver.join, 60)
    finally:
        if driver.is_alive():
            driver.terminate()
        server.should_exit = True
        await serving
        tm.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return results


def _code_version() -> str:
    """The commit of the radixlm source measured (with -dirty for uncommitted changes)."""
    import radixlm.srt

    where = os.path.dirname(os.path.dirname(os.path.abspath(radixlm.srt.__file__)))
    try:
        return subprocess.run(["git", "-C", where, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8000, help="tokens per stream")
    parser.add_argument("--routes", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--label", default="", help="what the measured code is (e.g. 'before', 'after')")
    parser.add_argument("--out", default=None, help="JSONL file to append the results to")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="the server's setting: /generate events hold only what is new")
    args = parser.parse_args(argv)
    results = measure(args.tokens, args.routes, args.incremental_streaming_output)
    reporter = Reporter(args.out, command=command_line())
    for figures in results:
        logprobs = TOP_K if "without logprobs" not in figures["route"] else 0
        reporter.emit({"bench": "stream_chunk_cost", "tokens": args.tokens, "top_logprobs": logprobs,
                       "label": args.label, "code": _code_version(),
                       "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
                       "machine": f"CPU, {os.cpu_count()} cores", "baseline": "the same stream's first chunks",
                       **figures})


if __name__ == "__main__":
    main()
