"""Data parallelism on the shared-prefix workload: G groups x M prompts (a shared prefix plus a
unique suffix, token ids, shuffled, fixed output length, ignore_eos), all sent at once, to

  (a) one replica: replica 0 of the DP=2 server, addressed directly (same process and settings)
  (b) DP=2 behind the cache-aware router (`radixlm serve --dp-size 2`)
  (c) DP=2 behind `radixlm router --policy round_robin` over the same two replicas

all started in this run, caches flushed before each. Prints one JSON line per system (output
tok/s, cached-token fraction = cached / prompt tokens, requests per worker) and one with the
ratios (b)/(a) and (b)/(c).

CPU (the default model; each CPU replica gets half the cores, so (a) uses half the machine):
  python -m benchmarks.bench_router --out benchmarks/results/cpu_router.jsonl
Two H200s, Llama-3.1-8B shape with dummy weights (64 groups x 16, 2048 shared + 256 unique
tokens, 128 out; the serving flags of bench_gpu_llama8b):
  python -m benchmarks.bench_router --preset gpu-llama8b --out benchmarks/results/gpu_h200x2_router.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx

from radixlm.srt.router.cli import raise_open_files_limit

from . import gpu_workloads
from . import serving_datasets as ds
from .cpu_noise import measure_noise
from .harness import Reporter, RouterProcess, ServerProcess, command_line, raise_on_sigterm, ratio
from .models import LLAMA3_TOKENIZER_GGUF, LLAMA_8B_CONFIG

# bench_gpu_llama8b's serving flags; the queue holds the whole workload (one replica alone
# gets all 1024 requests at once).
GPU_SERVER_ARGS = ("--max-running-requests 512 --cuda-graph-max-bs 512 --chunked-prefill-size 16384 "
                   "--max-prefill-tokens 16384 --max-queued-requests 1024")
PRESETS = {
    "cpu": dict(groups=8, per_group=8, prefix_len=512, unique_len=32, output_len=16,
                server_args="--max-total-tokens 65536"),
    "gpu-llama8b": dict(groups=64, per_group=16, prefix_len=2048, unique_len=256, output_len=128,
                        load_format="dummy", server_args=GPU_SERVER_ARGS),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model-path", default=None, help="passed to the replicas (gpu-llama8b: the Llama-3.1-8B "
                   "config in benchmarks/models)")
    p.add_argument("--load-format", default=None)
    p.add_argument("--tokenizer-path", default=None, help="gpu-llama8b: the Llama-3 tokenizer in benchmarks/models")
    p.add_argument("--server-args", default=None, help="more flags for the replicas, one string")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--per-group", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None)
    p.add_argument("--unique-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.preset == "gpu-llama8b":
        args.model_path = args.model_path or str(LLAMA_8B_CONFIG)
        args.tokenizer_path = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)
    return args


def replica_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("model_path", "load_format", "tokenizer_path"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), getattr(args, name)]
    return flags + shlex.split(args.server_args or "")


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    if vocab_size >= 128000:  # the Llama-3 vocabulary: the GPU benchmarks' own workload
        return gpu_workloads.shared_prefix_workload(args.groups, args.per_group, args.prefix_len, args.unique_len)
    pool = list(range(1000, vocab_size))
    wl = ds.shared_prefix_workload(pool, args.groups, args.per_group, args.prefix_len, args.unique_len,
                                   args.output_len, seed=3)
    return [list(c.turns[0].user_ids) for c in wl.conversations]


async def run(base_url: str, prompts: list[list[int]], output_len: int, headers: dict[str, str],
              timeout: float) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, headers=headers,
                                 trust_env=False) as client:
        r = await client.post("/flush_cache")
        r.raise_for_status()
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/generate", json={"input_ids": p, "sampling_params": params})
                                         for p in prompts), return_exceptions=True)
        seconds = time.perf_counter() - start
    ok = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    failed = [a if isinstance(a, Exception) else f"HTTP {a.status_code}: {a.text[:200]}" for a in answers
              if not (isinstance(a, httpx.Response) and a.status_code == 200)]
    metas = [a.json()["meta_info"] for a in ok]
    per_worker: dict[str, int] = {}
    for a in ok:
        w = a.headers.get("x-radixlm-worker", "direct")
        per_worker[w] = per_worker.get(w, 0) + 1
    out_tokens = sum(m["completion_tokens"] for m in metas)
    return {"requests": len(prompts), "completed": len(ok), "failed": len(failed),
            "first_error": str(failed[0])[:300] if failed else None, "seconds": round(seconds, 2),
            "output_tokens": out_tokens, "output_tok_s": round(out_tokens / seconds, 1),
            "cached_token_fraction": round(sum(m["cached_tokens"] for m in metas)
                                           / max(1, sum(m["prompt_tokens"] for m in metas)), 3),
            "requests_per_worker": per_worker}


def machine() -> str:
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.split("\n")
        gpus = [g for g in gpus if g.strip()]
        if gpus:
            return f"{len(gpus)}x {gpus[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU, {os.cpu_count()} cores"


def main() -> int:
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    raise_open_files_limit()  # a socket per request in flight
    args = resolve(build_parser().parse_args())
    report = Reporter(args.out)
    dp = ServerProcess("--dp-size", "2", *replica_flags(args), startup_timeout=args.startup_timeout, own_group=True)
    rr = None
    try:
        info = httpx.get(dp.base_url + "/get_server_info", timeout=30, trust_env=False).json()
        replicas = [w["url"] for w in info["workers"]]
        vocab = httpx.get(dp.base_url + "/get_model_info", timeout=30, trust_env=False).json()["vocab_size"]
        prompts = workload(args, vocab)
        rr = RouterProcess("--policy", "round_robin", "--request-timeout", str(args.request_timeout),
                           "--worker-urls", *replicas, own_group=True)
        common = {"bench": "router_shared_prefix", "machine": machine(), "groups": args.groups,
                  "per_group": args.per_group, "prefix_len": args.prefix_len, "unique_len": args.unique_len,
                  "output_len": args.output_len, "replica_args": shlex.join(replica_flags(args)),
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command_line()}
        warm = [p[:64] for p in prompts[:4]]  # first forwards of each shape, on both replicas
        asyncio.run(run(dp.base_url, warm, 2, {}, args.request_timeout))
        asyncio.run(run(rr.base_url, warm, 2, {}, args.request_timeout))
        results = {}
        for system, url in (("one_replica", replicas[0]), ("dp2_cache_aware", dp.base_url),
                            ("dp2_round_robin", rr.base_url)):
            # others_cpu_share: the machine's CPU used by anything but this script and the DP
            # server's process group during the run (the round-robin router's own share included)
            results[system], noise = measure_noise(
                lambda: asyncio.run(run(url, prompts, args.output_len, {}, args.request_timeout)), dp.proc.pid)
            report.emit({**common, "system": system, **results[system], **noise})
        a, b, c = (results[s]["output_tok_s"] for s in ("one_replica", "dp2_cache_aware", "dp2_round_robin"))
        report.emit({**common, "system": "ratios", "cache_aware_vs_one_replica": ratio(b, a),
                     "cache_aware_vs_round_robin": ratio(b, c),
                     "goals": {"cache_aware_vs_one_replica": ">= 1.9 (two GPUs)",
                               "cache_aware_vs_round_robin": ">= 1.3 (two GPUs)"}})
        return 0
    finally:
        if rr is not None:
            rr.stop()
        dp.stop()


if __name__ == "__main__":
    sys.exit(main())
