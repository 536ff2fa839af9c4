"""The schedule of `bench_multiturn --mode engine` without a GPU: the real scheduler (admission,
radix cache, host tier, eviction) over a fake engine that draws tokens at once, and a cost
model of each step on the Llama-3.1-8B shape. A model, not a measurement: it says where a
round's time goes and lets a scheduling change be tried in seconds on a CPU before a GPU run
measures it (bench_multiturn is the measure).

Cost model (H200, bf16): a decode step reads the weights (DECODE_STEP_S) plus its requests' KV
(KV_BYTES_PER_TOKEN at HBM_BYTES_PER_S); a prefill costs PREFILL_S_PER_TOKEN a token plus
EXTEND_STEP_S a step; a load-back moves KV_BYTES_PER_TOKEN a token at LOAD_BYTES_PER_S and is
counted apart (on the critical path as the engine runs it today: a step waits for its loads).
Against the run recorded on an H200 on 2026-12-04 (gpu_h200_multiturn.jsonl), with the
admission order of that code (radix.tiered.HOST_TOKEN_WEIGHT = 1): host tokens loaded 1,467,051
here against 1,468,992 there; rounds 2-5 15.3 s here (loads included) against 15.4 s; the
baseline's total 54.0 s against 50.9 s.

    python -m benchmarks.sim_multiturn [--conversations 128 --rounds 5 --max-total-tokens 120000]
"""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

from radixlm.srt.core.request import Req
from radixlm.srt.core.step import PendingStep, StepPlan, StepResult
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.server_args import ServerArgs

KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16
DECODE_STEP_S = 4.8e-3  # 16 GB of weights at ~3.3 TB/s
HBM_BYTES_PER_S = 4.0e12
PREFILL_S_PER_TOKEN = 16e9 / 600e12  # 2 x 8B FLOPs a token at ~600 TFLOP/s
EXTEND_STEP_S = 2e-3
LOAD_BYTES_PER_S = 50e9  # the host tier's measured load-back rate
EOS = 2


class FakeEngine:
    """Draws a token per sampling request at once (no model); the host tier's copies are free."""

    def __init__(self, loaded, args, req_to_token, num_kv_slots, *, eos_ids, grammar_backend,
                 host_kv_tokens=None, host_kv_bytes=None):
        self.overlap = True
        self.kv_bytes_per_token = KV_BYTES_PER_TOKEN
        self.host_kv_tokens = host_kv_tokens if host_kv_tokens is not None else (host_kv_bytes or 0) // KV_BYTES_PER_TOKEN
        self.plans: list[StepPlan] = []

    @staticmethod
    def kv_capacity(config, args) -> int:
        return args.cache.max_total_tokens

    def launch(self, plan: StepPlan) -> PendingStep:
        self.plans.append(plan)
        result = StepResult([1000 + len(r.output_ids) for r in plan.sampling_reqs])
        return PendingStep(plan, lambda: result)

    def move_kv(self, moves) -> None:
        pass

    def defer_host_pinning(self, seconds: float) -> None:
        pass

    def wait_kv_uploads(self) -> None:
        pass


def step_seconds(plan: StepPlan) -> float:
    if plan.decode:
        keys = sum(p.start + 1 for p in plan.parts)
        return DECODE_STEP_S + keys * KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S
    return EXTEND_STEP_S + sum(p.extend_len for p in plan.parts) * PREFILL_S_PER_TOKEN


def simulate(args: argparse.Namespace, tiers: bool) -> list[dict]:
    settings = dict(max_total_tokens=args.max_total_tokens, max_running_requests=512, chunked_prefill_size=8192,
                    context_length=args.history + args.rounds * (args.user_tokens + args.output_tokens) + 1,
                    device="cpu")
    if tiers:
        settings.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio)
    config = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=128256, context_len=settings["context_length"])
    loaded = SimpleNamespace(config=config, tokenizer=SimpleNamespace(eos_token_id=EOS, decode=lambda ids, **_: ""))
    sched = Scheduler(loaded, ServerArgs(**settings), engine_factory=FakeEngine)
    rng = random.Random(args.seed)
    histories = [[rng.randrange(100, 120000) for _ in range(args.history)] for _ in range(args.conversations)]
    rounds = []
    for r in range(args.rounds):
        params = SamplingParams(max_new_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for i, history in enumerate(histories):
            history += [rng.randrange(100, 120000) for _ in range(args.user_tokens)]
            reqs.append(Req(rid=f"{r}-{i}", origin_input_ids=list(history), sampling_params=params))
            sched.add_request(reqs[-1])
        first_plan, loaded_before = len(sched.engine.plans), getattr(sched.tree, "host_hit_tokens", 0)
        while sched.has_work or sched.pending is not None:
            sched.step()
        plans = sched.engine.plans[first_plan:]
        decode = [p for p in plans if p.decode]
        loaded_tokens = getattr(sched.tree, "host_hit_tokens", 0) - loaded_before
        steps_s = sum(map(step_seconds, plans))
        load_s = loaded_tokens * KV_BYTES_PER_TOKEN / LOAD_BYTES_PER_S
        rounds.append({"round": r + 1, "seconds": round(steps_s + load_s, 2), "steps_s": round(steps_s, 2),
                       "load_s": round(load_s, 2), "host_loaded_tokens": loaded_tokens,
                       "decode_steps": len(decode), "extend_steps": len(plans) - len(decode),
                       "mean_decode_batch": round(sum(len(p.parts) for p in decode) / max(1, len(decode)), 1),
                       "cached_fraction": round(sum(q.cached_tokens for q in reqs)
                                                / sum(len(q.origin_input_ids) for q in reqs), 3)})
        for history, req in zip(histories, reqs):
            history += req.output_ids
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=120000)
    parser.add_argument("--hicache-ratio", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    totals = {}
    for tiers in (False, True):
        rounds = simulate(args, tiers)
        system = "hicache" if tiers else "device-pool-only"
        totals[system] = {"total_s": round(sum(r["seconds"] for r in rounds), 2),
                          "rounds_2_on_s": round(sum(r["seconds"] for r in rounds[1:]), 2)}
        for line in rounds:
            print(json.dumps({"sim": "multiturn_round", "system": system, **line}))
        print(json.dumps({"sim": "multiturn", "system": system, **totals[system],
                          "load_s": round(sum(r["load_s"] for r in rounds), 2)}))
    base, ours = totals["device-pool-only"], totals["hicache"]
    print(json.dumps({"sim": "multiturn_compare", "model": "a schedule's cost model, not a measurement",
                      "total_ratio": round(ours["total_s"] / base["total_s"], 3),
                      "rounds_2_on_ratio": round(ours["rounds_2_on_s"] / base["rounds_2_on_s"], 3)}))


if __name__ == "__main__":
    main()
