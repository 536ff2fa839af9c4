"""Program sessions against a flood, with and without the hierarchical cache (docs/sessions.md).

Two programs make --calls sequential calls, each extending the one before by 30 tokens; before
every call a flood of --flood unrelated 120-token prompts runs. On a fresh server with a
--pool-token KV pool (and, with --hicache, a host tier of twice that), the programs run once
with session ids and once without. One line per run: the share of each later call's previous
prompt found cached, and how much of it was loaded back from the host tier.

    python -m benchmarks.bench_sessions --hicache --flood 6
    python -m benchmarks.bench_sessions --hicache --flood 12
"""

from __future__ import annotations

import argparse
import random

from .harness import ServerProcess

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(c, seed: int, with_sessions: bool, calls: int, flood: int) -> tuple[float, int]:
    """(share of the previous prompts found cached, tokens of it loaded from the host tier)."""
    rng = random.Random(seed)
    prompts = {f"bench-{seed}-{i}": ids(60, rng) for i in range(2)}
    cached = expected = host = 0
    for call in range(calls):
        r = c.post("/generate", json={"input_ids": [ids(120, rng) for _ in range(flood)],
                                      "sampling_params": {**GREEDY, "max_new_tokens": 1}})
        r.raise_for_status()
        for sid, prompt in prompts.items():
            body = {"input_ids": prompt, "sampling_params": GREEDY, **({"session_id": sid} if with_sessions else {})}
            meta = c.post("/generate", json=body).json()["meta_info"]
            if call:
                cached += meta["cached_tokens"]
                expected += len(prompt) - 30
                host += (meta.get("cached_tokens_details") or {}).get("host", 0)
            prompts[sid] = prompt + ids(30, rng)
    for sid in prompts:
        c.post("/end_session", json={"session_id": sid})
    return cached / expected, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=512, help="KV pool tokens")
    parser.add_argument("--flood", type=int, default=6, help="unrelated prompts before every call")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--hicache", action="store_true", help="with --enable-hierarchical-cache (host: 2x pool)")
    args = parser.parse_args()
    flags = ["--max-total-tokens", str(args.pool), "--session-ttl", "600"]
    server = ServerProcess(*flags, *(["--enable-hierarchical-cache"] if args.hicache else []))
    try:
        with server.client() as c:
            for with_sessions in (True, False):
                share, host = run(c, 1 if with_sessions else 2, with_sessions, args.calls, args.flood)
                print(f"pool {args.pool} hicache={args.hicache} flood {args.flood}x120 sessions={with_sessions}: "
                      f"cached share {share:.2f}, {host} tokens of it from the host tier", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
