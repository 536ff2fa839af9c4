"""Serving load generator for radixlm's native /generate API, with a baseline in the same run.

Sends a synthetic token-id workload (random, shared-prefix or multi-turn; see
serving_datasets.py) with Poisson arrivals (`--request-rate`, inf = all at once) or a fixed
number of requests in flight (`--max-concurrency`), streams every response, and reports
throughput and TTFT / inter-token / end-to-end latency percentiles as JSON lines. Output
lengths are fixed (`ignore_eos`, greedy). The baseline runs after ours, never beside it:
`hf` runs HF transformers batched `generate` on the same prompts in this process,
`no-radix` repeats the workload against a second server started with --disable-radix-cache.
The cache is flushed before every timed run. Servers this script starts are stopped (SIGTERM,
then SIGKILL of their process group) on exit, errors and Ctrl-C.

    python -m benchmarks.bench_serving --preset cpu-random16 --out benchmarks/results/cpu_serving.jsonl
    python -m benchmarks.bench_serving --dataset multi-turn --max-concurrency 4 --baseline no-radix
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import math
import os
import random
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from . import hf_baseline
from . import serving_datasets as ds
from .cpu_noise import measure_noise, wait_until_quiet
from .harness import Reporter, ServerProcess, command_line, raise_on_sigterm

logger = logging.getLogger("bench.serving")

PRESETS: dict[str, dict[str, Any]] = {
    # 16 requests of ~128 prompt tokens, 64 new tokens each, all at once, against HF generate.
    "cpu-random16": dict(dataset="random", num_prompts=16, random_input_len=128, random_range_ratio=0.1,
                         random_output_len=64, request_rate=math.inf, baseline="hf", goal=2.0),
    # 8 groups x 8 prompts sharing a 1024-token prefix (+32 unique), 32 new tokens, all at once,
    # against the same server without the radix cache; both get KV room for all 64 at once.
    "cpu-shared-prefix": dict(dataset="shared-prefix", sp_groups=8, sp_prompts_per_group=8, sp_prefix_len=1024,
                              sp_suffix_len=32, sp_output_len=32, request_rate=math.inf,
                              baseline="no-radix", server_args="--max-total-tokens 81920", goal=3.0),
}
_LOCAL_HOSTS = {"127.0.0.1", "localhost"}
NOISY_SHARE = 0.05  # others used > 5% of the cores during a run: its numbers are suspect


# ---- one request --------------------------------------------------------------------------------

@dataclass
class RequestResult:
    prompt_len: int
    wanted_output_len: int
    ok: bool = False
    error: str = ""
    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)  # a chunk of k tokens gives k gaps of gap/k
    e2e: float = 0.0
    cached_tokens: int = 0
    finish_reason: Any = None


async def send_request(client: httpx.AsyncClient, prompt: list[int], output_len: int,
                       timeout: float) -> RequestResult:
    result = RequestResult(len(prompt), output_len)
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_into(client, body, result, start), timeout)
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timed out after {timeout:.0f}s"
    except (httpx.HTTPError, ValueError) as e:
        result.ok, result.error = False, f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - start
    return result


async def _stream_into(client: httpx.AsyncClient, body: dict, result: RequestResult, start: float) -> None:
    last = start
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = f"stream error: {chunk['error']}"
                return
            now = time.perf_counter()
            new = len(chunk.get("output_ids", [])) - len(result.output_ids)
            if new > 0:
                if not result.output_ids:
                    result.ttft = now - start  # tokens arriving with the first one count in TTFT
                else:
                    result.itls += [(now - last) / new] * new
                last = now
                result.output_ids = list(chunk["output_ids"])
            meta = chunk.get("meta_info", {})
            result.cached_tokens = meta.get("cached_tokens", result.cached_tokens)
            result.finish_reason = meta.get("finish_reason", result.finish_reason)
    result.ok = bool(result.output_ids) or result.wanted_output_len == 0
    if not result.ok:
        result.error = "stream ended without output"


# ---- one run of a workload ----------------------------------------------------------------------

async def run_workload(base_url: str, workload: ds.Workload, request_rate: float, max_concurrency: int | None,
                       seed: int, request_timeout: float, max_run_time: float) -> tuple[list[RequestResult], float]:
    """Conversations arrive by a Poisson process (rate inf: all at t=0); a conversation's turns
    go one after another. `max_concurrency` caps the requests in flight."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in workload.conversations:
        arrivals.append(t)
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=max(1, workload.num_requests), max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=10.0, read=request_timeout, write=30.0, pool=request_timeout)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()

        async def conversation(conv: ds.Conversation, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            answers: list[list[int]] = []
            for turn_index, turn in enumerate(conv.turns):
                prompt = conv.prompt_ids(turn_index, answers)
                if gate:
                    async with gate:
                        res = await send_request(client, prompt, turn.output_len, request_timeout)
                else:
                    res = await send_request(client, prompt, turn.output_len, request_timeout)
                results.append(res)
                if not res.ok:
                    return  # later turns cannot be built; they count as not sent
                answers.append(res.output_ids)

        tasks = [asyncio.ensure_future(conversation(c, a)) for c, a in zip(workload.conversations, arrivals)]
        done, pending = await asyncio.wait(tasks, timeout=max_run_time)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        duration = time.perf_counter() - start
    if pending:
        logger.warning("run-time cap of %.0fs hit: %d conversations cancelled", max_run_time, len(pending))
    return results, duration


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def summarize(results: list[RequestResult], duration: float, num_requests: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(len(r.output_ids) for r in ok)
    ttfts, e2es = [r.ttft for r in ok], [r.e2e for r in ok]
    itls = [gap for r in ok for gap in r.itls]
    out: dict[str, Any] = {
        "num_requests": num_requests, "completed": len(ok), "failed": num_requests - len(ok),
        "duration_s": round(duration, 3), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / duration, 2), "total_tok_s": round((prompt_tokens + output_tokens) / duration, 2),
        "req_s": round(len(ok) / duration, 3),
    }
    for name, values in (("ttft", ttfts), ("itl", itls), ("e2e", e2es)):
        out[f"{name}_ms_p50"], out[f"{name}_ms_p99"] = _ms(_pct(values, 50)), _ms(_pct(values, 99))
        out[f"{name}_ms_max"] = _ms(max(values)) if values else None
    out["cached_ratio_mean"] = round(statistics.fmean(r.cached_tokens / r.prompt_len for r in ok), 4) if ok else None
    out["cached_tokens"] = sum(r.cached_tokens for r in ok)
    out["output_len_mismatch"] = sum(len(r.output_ids) != r.wanted_output_len for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:5]
    return out


# ---- orchestration ------------------------------------------------------------------------------

def build_workload(args: argparse.Namespace, pool: list[int]) -> ds.Workload:
    if args.dataset == "random":
        return ds.random_workload(pool, args.num_prompts, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.random_output_range_ratio, args.seed)
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_workload(pool, args.sp_groups, args.sp_prompts_per_group, args.sp_prefix_len,
                                         args.sp_suffix_len, args.sp_output_len, args.seed)
    return ds.multi_turn_workload(pool, args.mt_conversations, args.mt_turns, args.mt_first_len,
                                  args.mt_user_len, args.mt_output_len, args.seed)


def _control(base_url: str, method: str, path: str) -> httpx.Response:
    resp = httpx.request(method, base_url + path, timeout=60, trust_env=False)
    resp.raise_for_status()
    return resp


def _flush(base_url: str, timeout: float = 60.0) -> None:
    """The server refuses a flush while requests run (e.g. aborts after a timeout still draining)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.post(base_url + "/flush_cache", timeout=60, trust_env=False)
        if resp.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"flush_cache refused for {timeout:.0f}s: {resp.text[:200]}")
        time.sleep(1.0)


def repeat_runs(system: str, workload: ds.Workload, args: argparse.Namespace, pgid: int | None,
                attributable: bool, one_run) -> list[dict[str, Any]]:
    """`num_runs` timed runs of one_run() -> stats; a run during which other processes used the
    CPU is reported with "noisy": true and, while `retry_noisy` allows, repeated."""
    lines, clean, retries = [], 0, args.retry_noisy
    while clean < args.num_runs:
        quiet = wait_until_quiet(args.wait_quiet, pgid, NOISY_SHARE) if args.wait_quiet else None
        stats, noise = measure_noise(one_run, pgid, attributable)
        noisy = (noise["others_cpu_share"] or 0) > NOISY_SHARE
        line = {"bench": "serving", "system": system, "dataset": workload.name, "run": len(lines), **stats,
                **noise, "others_cpu_share_before": quiet, "noisy": noisy}
        lines.append(line)
        Reporter(args.out).emit(line)
        if noisy and retries > 0:
            retries -= 1
        else:
            clean += 1
    return lines


def bench_server(system: str, base_url: str, pgid: int | None, workload: ds.Workload, args: argparse.Namespace,
                 pad_token: int) -> list[dict[str, Any]]:
    """Warm-up, then timed runs, each after a cache flush."""
    warm = asyncio.run(run_workload(base_url, ds.random_workload([pad_token], 2, 16, 4, 0, 0, 0), math.inf,
                                    None, 0, args.request_timeout, args.max_run_time))[0]
    if not all(r.ok for r in warm):
        raise RuntimeError(f"{system}: warm-up failed: {[r.error for r in warm]}")

    def one_run() -> dict[str, Any]:
        _flush(base_url)
        results, duration = asyncio.run(run_workload(base_url, workload, args.request_rate, args.max_concurrency,
                                                     args.seed, args.request_timeout, args.max_run_time))
        info = _control(base_url, "GET", "/get_server_info").json()
        return {**summarize(results, duration, workload.num_requests), "server_cache": info.get("cache"),
                "server_kv_leaked": (info.get("kv") or {}).get("leaked")}

    return repeat_runs(system, workload, args, pgid, pgid is not None, one_run)


def bench_hf(workload: ds.Workload, args: argparse.Namespace, tokenizer, pad_token: int) -> list[dict[str, Any]]:
    model = hf_baseline.load_hf_model(args.model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_baseline.warm_up(model, pad_id, pad_token)
    return repeat_runs("hf-transformers-generate", workload, args, None, True, lambda: hf_baseline.run_hf(
        model, workload, args.hf_batch_size, pad_id, deadline=time.perf_counter() + args.max_run_time))


def _prefer_clean(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if not line["noisy"]] or lines


def with_server(server_args: list[str], args: argparse.Namespace, fn):
    server = ServerProcess(*server_args, startup_timeout=args.startup_timeout, own_group=True)
    try:
        return fn(server.base_url, server.proc.pid)
    finally:
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="the two reported CPU numbers; flags override it")
    p.add_argument("--base-url", help="an already running server (127.0.0.1 only); none is started")
    p.add_argument("--baseline-base-url", help="for --baseline no-radix with --base-url: the no-cache server")
    p.add_argument("--server-args", default="", help="extra flags for the servers started, e.g. '--max-total-tokens 65536'")
    p.add_argument("--model-path", default=None, help="passed to the server and the HF baseline")
    p.add_argument("--baseline", choices=["hf", "no-radix", "none"], default="none")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch (default: all requests)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="random")
    int_flags = (("num-prompts", 16), ("random-input-len", 128), ("random-output-len", 64), ("sp-groups", 8),
                 ("sp-prompts-per-group", 8), ("sp-prefix-len", 1024), ("sp-suffix-len", 32), ("sp-output-len", 32),
                 ("mt-conversations", 4), ("mt-turns", 4), ("mt-first-len", 256), ("mt-user-len", 32),
                 ("mt-output-len", 32))
    for name, default in int_flags:  # dataset shapes: random-*, sp-* (shared-prefix), mt-* (multi-turn)
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="input len uniform in L*(1 -/+ r)")
    p.add_argument("--random-output-range-ratio", type=float, default=0.0)
    p.add_argument("--num-runs", type=int, default=1, help="timed runs per system (cache flushed before each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-run-time", type=float, default=1200.0, help="seconds per timed run, then cancel")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each timed run, wait up to this many seconds for other processes to go quiet")
    p.add_argument("--retry-noisy", type=int, default=0, help="extra runs allowed to replace noisy ones")
    p.add_argument("--goal", type=float, default=None, help="ratio target reported with the summary")
    p.add_argument("--out", help="append the command and JSON lines to this file")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    for url in (args.base_url, args.baseline_base_url):
        if url and urlparse(url).hostname not in _LOCAL_HOSTS:
            parser.error(f"--base-url: only 127.0.0.1 is allowed, got {url}")
    if args.baseline == "no-radix" and args.base_url and not args.baseline_base_url:
        parser.error("--baseline no-radix with --base-url needs --baseline-base-url")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency: must be >= 1")
    if args.request_rate <= 0:
        parser.error("--request-rate: must be > 0")
    if args.num_runs < 1:
        parser.error("--num-runs: must be >= 1")
    return args


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    from radixlm.srt.executor.model_loader import load_model

    tokenizer = load_model(args.model_path, with_weights=False).tokenizer
    pool = ds.wordlike_token_pool(tokenizer)
    workload = build_workload(args, pool)
    server_args = shlex.split(args.server_args) + (["--model-path", args.model_path] if args.model_path else [])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        header = {"bench": "serving", "command": command_line(),
                  "time": datetime.datetime.now().isoformat(timespec="seconds"), "dataset_params": workload.params,
                  "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
                  "server_args": args.server_args}
        with open(args.out, "a") as f:
            f.write(json.dumps(header) + "\n")
    logger.info("workload %s: %d requests, %s", workload.name, workload.num_requests, workload.params)

    run_ours = lambda url, pgid=None: bench_server("radixlm", url, pgid, workload, args, pool[0])
    ours = run_ours(args.base_url) if args.base_url else with_server(server_args, args, run_ours)
    if args.baseline == "none":
        return 0
    if args.baseline == "hf":
        theirs = bench_hf(workload, args, tokenizer, pool[0])
    else:
        run_theirs = lambda url, pgid=None: bench_server("radixlm-no-radix-cache", url, pgid, workload, args, pool[0])
        theirs = (run_theirs(args.baseline_base_url) if args.base_url
                  else with_server([*server_args, "--disable-radix-cache"], args, run_theirs))
    ours, theirs = _prefer_clean(ours), _prefer_clean(theirs)
    ours_tps = round(statistics.median(line["output_tok_s"] for line in ours), 2)
    theirs_tps = round(statistics.median(line["output_tok_s"] for line in theirs), 2)
    summary = {"bench": "serving", "system": ours[0]["system"], "baseline": theirs[0]["system"],
               "dataset": workload.name, "metric": "output_tok_s (median of runs, clean ones if any)",
               "runs": [len(ours), len(theirs)],
               "ours": ours_tps, "theirs": theirs_tps, "ratio": round(ours_tps / theirs_tps, 3) if theirs_tps else None,
               "failed": sum(line["failed"] for line in ours + theirs),
               "others_cpu_share_max": max((line["others_cpu_share"] or 0) for line in ours + theirs)}
    summary["noisy"] = summary["others_cpu_share_max"] > NOISY_SHARE
    if args.goal:
        summary.update(goal=args.goal, meets_goal=summary["ratio"] is not None and summary["ratio"] >= args.goal)
    Reporter(args.out).emit(summary)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # servers were stopped on the way out
        sys.exit(130)
