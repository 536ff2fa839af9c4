"""Agent programs: loops of calls with tool results appended, many at once.

--part sessions: N concurrent agent programs (async), each making --calls sequential calls;
after each call a tool result (random words) is appended and the tool "runs" for --tool-s
seconds, so the context grows call by call. The server's KV pool holds about half the
programs' working set (N x final context), so while a program waits on its tool, the others
push its prefix out of an LRU pool. Run twice, each on a fresh `radixlm serve` with the same
pool: without sessions (the baseline), then with program sessions (each program's latest
prefix protected between its calls, docs/sessions.md). One line per run (wall time,
programs/s, prompt tokens, recomputed prefill tokens = prompt - cached), then the ratio line
(goal: throughput >= 1.5x on CPU). --pairs N runs each system N times, alternating which goes
first, and takes the median of the pairs' ratios (a shared 2-core machine drifts).
--server-args adds flags to both servers.

--part runner: the same server, 256 short programs (three calls each) run by the thread-pool
`run_batch` of a sync program (the baseline) and by `arun_batch` of the same program written
async, both at max_concurrency 256: wall time and this client's CPU time (user + system, all
threads), and whether the two gave the same greedy texts.

    python -m benchmarks.bench_agents --out benchmarks/results/cpu_agents.jsonl
    python -m benchmarks.bench_agents --part sessions --pairs 3 --session-total-tokens 6800
    python -m benchmarks.bench_agents --part runner --programs 32
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import resource
import shlex
import signal
import statistics
import sys
import time
from datetime import date
from typing import Any

import httpx

import radixlm as sgl

from .harness import Reporter, ServerProcess, command_line, raise_on_sigterm, ratio

logger = logging.getLogger("bench.agents")

SESSION_GOALS = {"throughput_ratio_min": 1.5}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def tool_result(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# ---- sessions -------------------------------------------------------------------------------------

def agent_program(calls: int, output_tokens: int, tool_words: int, tool_s: float) -> sgl.SglFunction:
    @sgl.function
    async def agent(s, task: int):
        rng = random.Random(task)
        s += f"Task {task}: " + tool_result(rng, tool_words) + "\n"
        for call in range(calls):
            s += f"Step {call}:" + sgl.gen(f"step{call}", max_tokens=output_tokens, ignore_eos=True)
            await s.get(f"step{call}")
            await asyncio.sleep(tool_s)  # the tool runs; other programs' calls fill the pool
            s += "\nTool: " + tool_result(rng, tool_words) + "\n"

    return agent


def session_run(args: argparse.Namespace, sessions: bool, pool_tokens: int) -> dict[str, Any]:
    server_args = ["--max-total-tokens", str(pool_tokens), "--max-running-requests", str(args.programs)]
    if args.session_total_tokens is not None:
        server_args += ["--session-total-tokens", str(args.session_total_tokens)]
    server_args += shlex.split(args.server_args)
    srv = ServerProcess(*server_args)
    try:
        backend = sgl.RuntimeEndpoint(srv.base_url, sessions=sessions)
        agent = agent_program(args.calls, args.output_tokens, args.tool_words, args.tool_s)
        start = time.perf_counter()
        states = agent.run_batch([{"task": i} for i in range(args.programs)], backend=backend, temperature=0,
                                 max_concurrency=args.programs)
        wall = time.perf_counter() - start
        failed = sum(s.error() is not None for s in states)
        metas = [s.get_meta_info(f"step{c}") for s in states if s.error() is None for c in range(args.calls)]
        prompt = sum(m["prompt_tokens"] for m in metas)
        cached = sum(m.get("cached_tokens", 0) for m in metas)
        info = httpx.get(srv.base_url + "/get_server_info", timeout=30).json()
        return {"bench": "agents_sessions", "system": "radixlm-sessions" if sessions else "radixlm-lru",
                "server_args": " ".join(server_args), "programs": args.programs, "calls": args.calls,
                "failed": failed, "wall_s": round(wall, 3), "programs_per_s": round(args.programs / wall, 4),
                "prompt_tokens": prompt, "cached_tokens": cached, "recomputed_prefill_tokens": prompt - cached,
                "texts": [s.text() for s in states if s.error() is None], "sessions": info.get("sessions")}
    finally:
        srv.stop()


def working_set_tokens(args: argparse.Namespace) -> int:
    """One program's final context in tokens, measured by the server's tokenizer, times N."""
    rng = random.Random(0)
    text = "Task 0: " + tool_result(rng, args.tool_words) + "\n"
    text += "".join("Step 0:" + " x" * args.output_tokens + "\nTool: " + tool_result(rng, args.tool_words) + "\n"
                    for _ in range(args.calls))
    srv = ServerProcess("--max-total-tokens", "4096")
    try:
        tokens = httpx.post(srv.base_url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    finally:
        srv.stop()
    return len(tokens) * args.programs


def run_sessions(args: argparse.Namespace, report: Reporter) -> None:
    """--pairs runs of each system on fresh servers, alternating which goes first (a shared
    machine drifts); the ratio line gives each pair's throughput ratio and their median."""
    working_set = working_set_tokens(args)
    pool = args.pool_tokens or working_set // 2
    pairs = []
    for pair in range(args.pairs):
        lines = {}
        for sessions in (False, True) if pair % 2 == 0 else (True, False):
            line = session_run(args, sessions, pool)
            texts = line.pop("texts")
            lines[sessions] = (line, texts)
            report.emit({**line, "working_set_tokens": working_set, "pair": pair, **framing()})
        pairs.append(lines)
    throughputs = [ratio(p[True][0]["programs_per_s"], p[False][0]["programs_per_s"]) for p in pairs]
    recomputed = [ratio(p[True][0]["recomputed_prefill_tokens"], p[False][0]["recomputed_prefill_tokens"])
                  for p in pairs]
    throughput = statistics.median(throughputs)
    report.emit({"bench": "agents_sessions_ratio", "system": "radixlm-sessions",
                 "baseline": "radixlm-lru: the same programs and pool without sessions, measured in this run",
                 "throughput_ratio": throughput, "pair_throughput_ratios": throughputs,
                 "recomputed_prefill_ratio": statistics.median(recomputed),
                 "same_texts": all(p[True][1] == p[False][1] for p in pairs), "goals": SESSION_GOALS,
                 "meets_goal": throughput >= SESSION_GOALS["throughput_ratio_min"], **framing()})


# ---- runner ---------------------------------------------------------------------------------------

@sgl.function
def short_sync(s, task: int):
    for call in range(3):
        s += f"Item {task}.{call}:" + sgl.gen(f"x{call}", max_tokens=2)
        s += f" (tool {len(s[f'x{call}'])})\n"


@sgl.function
async def short_async(s, task: int):
    for call in range(3):
        s += f"Item {task}.{call}:" + sgl.gen(f"x{call}", max_tokens=2)
        s += f" (tool {len(await s.get(f'x{call}'))})\n"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_batch(run) -> tuple[list[Any], float, float]:
    cpu, start = cpu_seconds(), time.perf_counter()
    states = run()
    return states, time.perf_counter() - start, cpu_seconds() - cpu


def run_runner(args: argparse.Namespace, report: Reporter) -> None:
    srv = ServerProcess("--max-total-tokens", "16384", "--max-running-requests", str(min(args.programs, 256)))
    try:
        backend = sgl.RuntimeEndpoint(srv.base_url)
        items = [{"task": i} for i in range(args.programs)]
        short_sync.run_batch(items[:8], backend=backend, temperature=0)  # warm both paths once
        short_async.run_batch(items[:8], backend=backend, temperature=0)
        threads, t_wall, t_cpu = timed_batch(lambda: short_sync.run_batch(
            items, backend=backend, temperature=0, max_concurrency=args.programs))
        tasks, a_wall, a_cpu = timed_batch(lambda: short_async.run_batch(
            items, backend=backend, temperature=0, max_concurrency=args.programs))
    finally:
        srv.stop()
    same = [s.text() for s in threads] == [s.text() for s in tasks]
    for system, wall, cpu in (("thread-pool run_batch (sync program)", t_wall, t_cpu),
                              ("asyncio arun_batch (async program)", a_wall, a_cpu)):
        report.emit({"bench": "agents_runner", "system": system, "programs": args.programs, "calls": 3,
                     "max_concurrency": args.programs, "wall_s": round(wall, 3), "client_cpu_s": round(cpu, 3),
                     **framing()})
    report.emit({"bench": "agents_runner_ratio", "system": "asyncio arun_batch",
                 "baseline": "thread-pool run_batch of the same program, same server, measured in this run",
                 "wall_ratio": ratio(a_wall, t_wall), "client_cpu_ratio": ratio(a_cpu, t_cpu), "same_texts": same,
                 **framing()})


# ---- main -----------------------------------------------------------------------------------------

_machine = "2-core CPU devel box"


def framing() -> dict[str, Any]:
    return {"date": date.today().isoformat(), "machine": _machine}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("sessions", "runner", "all"), default="all")
    parser.add_argument("--programs", type=int, default=None, help="sessions: 16; runner: 256")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=1, help="sessions: runs of each system, alternating")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--tool-words", type=int, default=60)
    parser.add_argument("--tool-s", type=float, default=0.5)
    parser.add_argument("--pool-tokens", type=int, default=0, help="KV pool; 0: half the working set")
    parser.add_argument("--session-total-tokens", type=int, default=None, help="the server's bound (unset: its default)")
    parser.add_argument("--server-args", default="", help="sessions: more flags for both servers")
    parser.add_argument("--machine", default=_machine)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    globals()["_machine"] = args.machine
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    report = Reporter(args.out, command_line(), device=lambda: "cpu")
    if args.part in ("sessions", "all"):
        run_sessions(argparse.Namespace(**{**vars(args), "programs": args.programs or 16}), report)
    if args.part in ("runner", "all"):
        run_runner(argparse.Namespace(**{**vars(args), "programs": args.programs or 256}), report)


if __name__ == "__main__":
    main()
