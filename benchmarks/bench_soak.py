"""Soak: mixed traffic against one server for a while, then what it left behind.

Traffic (127.0.0.1 only; every loop is bounded by --duration): plain /generate, constrained
(regex and JSON schema), OpenAI chat, streams the client drops after a few events, requests
aborted by rid while running, and bad requests (each must get its 4xx, never a 5xx). Reports one
JSON line: requests completed per kind, errors by kind (an unexpected status or exception),
p50/p99 latency of the completed requests, RSS growth of each server process (from after a
warm-up round to the end), and KV slots leaked (the server's own count once traffic stopped,
with nothing protected and nothing running).

This is a robustness run, not a speed comparison: it has no baseline; its goals are 0
unexpected errors, 0 leaked slots and RSS growth < 5%.

    python -m benchmarks.bench_soak --duration 600                 # starts a server
    python -m benchmarks.bench_soak --url http://127.0.0.1:30000   # an already running one
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from collections import Counter
from typing import Any

import httpx

from .harness import Reporter, ServerProcess, command_line

KINDS = ("plain", "constrained", "chat", "stream_drop", "abort", "bad")
_BAD_BODIES = [  # each is a 400 (or 413) naming the problem
    {"text": "hi", "sampling_params": {"top_k": 2**64 - 1}},
    {"text": "hi", "sampling_params": {"n": 2, "seed": "x"}},
    {"text": "hi", "rid": {"a": 1}},
    {"text": ["a", "b"], "rid": ["r1"]},
    {"text": True, "input_ids": [[1]]},
    {"text": "hi", "stream": "no"},
    {"text": "hi", "sampling_params": {"temperature": -1}},
    {"text": "hi", "sampling_params": {"regex": "("}},
    {"input_ids": [10**9]},
    {"text": "hi", "sampling_params": {"logit_bias": {"999999999": 1}}},
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def server_pids(main_pid: int, log_path: str) -> dict[str, int]:
    """The main process and its children by name, from the server's "children: ..." log line."""
    with open(log_path) as f:
        children = re.findall(r"(\w+) pid (\d+)", f.read())
    return {"main": main_pid, **{name: int(pid) for name, pid in children}}


class Soak:
    def __init__(self, url: str, concurrency: int, seed: int):
        self.url = url
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.completed: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.rid_counter = 0

    def _unexpected(self, kind: str, what: str) -> None:
        self.errors[f"{kind}: {what}"] += 1

    async def one(self, c: httpx.AsyncClient, kind: str) -> None:
        started = time.perf_counter()
        try:
            ok = await getattr(self, f"_{kind}")(c)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            self._unexpected(kind, type(e).__name__)
            return
        if ok:
            self.completed[kind] += 1
            if kind != "bad":
                self.latencies.append(time.perf_counter() - started)

    def _check(self, kind: str, r: httpx.Response, expected: tuple[int, ...] = (200,)) -> bool:
        if r.status_code not in expected:
            self._unexpected(kind, f"HTTP {r.status_code}")
            return False
        return True

    async def _plain(self, c: httpx.AsyncClient) -> bool:
        n = self.rng.randint(4, 24)
        r = await c.post("/generate", json={"text": f"Story {self.rng.randint(0, 99)}: once upon a time",
                                            "sampling_params": {"max_new_tokens": n, "temperature": 0.7}})
        return self._check("plain", r)

    async def _constrained(self, c: httpx.AsyncClient) -> bool:
        params = self.rng.choice([
            {"regex": r"(yes|no), because [a-z ]{1,20}\.", "max_new_tokens": 32},
            {"json_schema": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
             "max_new_tokens": 24},
        ])
        r = await c.post("/generate", json={"text": "Answer:", "sampling_params": params})
        return self._check("constrained", r)

    async def _chat(self, c: httpx.AsyncClient) -> bool:
        body = {"model": "default", "max_tokens": 12, "messages": [{"role": "user", "content": "Say hello."}]}
        if self.rng.random() < 0.3:  # ban or favour a few tokens
            body["logit_bias"] = {str(self.rng.randrange(1000)): self.rng.choice([-100, 5]) for _ in range(3)}
        r = await c.post("/v1/chat/completions", json=body)
        return self._check("chat", r)

    async def _stream_drop(self, c: httpx.AsyncClient) -> bool:
        keep = self.rng.randint(1, 4)
        body = {"text": "Count: one, two,", "stream": True, "sampling_params": {"max_new_tokens": 64,
                                                                                "ignore_eos": True}}
        async with c.stream("POST", "/generate", json=body) as r:
            if not self._check("stream_drop", r):
                return False
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= keep:
                    break  # the client goes away mid-stream
        return True

    async def _abort(self, c: httpx.AsyncClient) -> bool:
        self.rid_counter += 1
        rid = f"soak-{os.getpid()}-{self.rid_counter}"
        body = {"text": "A long tale:", "rid": rid, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        running = asyncio.ensure_future(c.post("/generate", json=body))
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        aborted = await c.post("/abort_request", json={"rid": rid})
        r = await running
        return self._check("abort", aborted) and self._check("abort", r)

    async def _bad(self, c: httpx.AsyncClient) -> bool:
        r = await c.post("/generate", json=self.rng.choice(_BAD_BODIES))
        return self._check("bad", r, (400,))

    async def worker(self, deadline: float, kinds: tuple[str, ...]) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as c:
            while time.monotonic() < deadline:
                await self.one(c, self.rng.choice(kinds))

    async def run(self, duration: float, kinds: tuple[str, ...] = KINDS) -> None:
        deadline = time.monotonic() + duration
        await asyncio.gather(*(self.worker(deadline, kinds) for _ in range(self.concurrency)))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _settled_kv(url: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        if info["num_running_reqs"] == info["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one on the embedded model)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", help="append the JSON line to this file too")
    args = parser.parse_args()

    server = ServerProcess("--max-total-tokens", "16384", startup_timeout=600) if args.url is None else None
    url = args.url or server.base_url
    try:
        soak = Soak(url, args.concurrency, args.seed)
        asyncio.run(soak.run(min(30.0, args.duration / 10)))  # warm-up: allocator and caches grow first
        pids = server_pids(server.proc.pid, server.log_path) if server else {}
        rss_before = {name: rss_kib(pid) for name, pid in pids.items()}
        soak = Soak(url, args.concurrency, args.seed + 1)
        started = time.monotonic()
        asyncio.run(soak.run(args.duration))
        elapsed = time.monotonic() - started
        info = _settled_kv(url)
        rss_after = {name: rss_kib(pid) for name, pid in pids.items()}
        growth = {name: round(100.0 * (rss_after[name] - rss_before[name]) / rss_before[name], 2) for name in pids}
        line = {
            "benchmark": "soak", "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
            "requests_completed": dict(soak.completed), "requests_completed_total": sum(soak.completed.values()),
            "errors_by_kind": dict(soak.errors), "unexpected_errors": sum(soak.errors.values()),
            "latency_p50_s": _percentile(soak.latencies, 0.5), "latency_p99_s": _percentile(soak.latencies, 0.99),
            "rss_kib_before": rss_before, "rss_kib_after": rss_after, "rss_growth_pct": growth,
            "kv_leaked": info["kv"]["leaked"], "kv_protected_after": info["kv"]["protected"],
            "command": command_line(),
        }
    finally:
        if server is not None:
            server.stop(timeout=60)
    Reporter(args.record).emit(line)


if __name__ == "__main__":
    main()
