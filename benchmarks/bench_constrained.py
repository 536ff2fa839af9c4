"""What constraints cost, and what jump-forward saves.

decode: decode tokens/s with a JSON schema against the same Engine unconstrained, at batch 1
and batch 16, same prompts, same number of output tokens (the schema admits a long array, so
no request ends early; jump-forward off, so both take one step per token). Runs alternate and
the median is kept. Also the per-token mask cost in microseconds: filling one request's
bitmask from its matcher, and applying a batch's bitmask to the logits.

jump: a JSON extraction program in the language, on two servers that differ only in
`--disable-jump-forward`; wall time for the batch and decode steps saved.

    python -m benchmarks.bench_constrained decode|jump|all [--out benchmarks/results/cpu_constrained.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from .harness import Reporter, command_line, timed

# Never completes before max_new_tokens: 100+ integers are needed to close the array.
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 100}
PROMPTS = [f"List {i + 5} numbers as a JSON array of integers:" for i in range(16)]


def bench_decode(args, report: Reporter) -> None:
    from radixlm.srt import Engine

    engine = Engine(max_total_tokens=16384, disable_jump_forward=True)
    n = args.new_tokens
    plain = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    constrained = {**plain, "json_schema": json.dumps(LONG_ARRAY)}
    for batch in (1, 16):
        prompts = PROMPTS[:batch]
        timings: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        engine.generate(prompts, constrained)  # warm-up: compiles the grammar, fills caches
        for _ in range(args.runs):
            for name, params in (("unconstrained", plain), ("json_schema", constrained)):
                engine.flush_cache()
                outs, seconds = timed(engine.generate, prompts, params)
                timings[name].append(seconds)
                assert all(o["meta_info"]["completion_tokens"] == n for o in outs), "a request ended early"
        tok_s = {k: batch * n / statistics.median(v) for k, v in timings.items()}
        report.emit({"bench": "constrained_decode", "batch": batch, "new_tokens": n, "runs": args.runs,
                     "unconstrained_tok_s": round(tok_s["unconstrained"], 2),
                     "json_schema_tok_s": round(tok_s["json_schema"], 2), "baseline": "unconstrained",
                     "ratio": round(tok_s["json_schema"] / tok_s["unconstrained"], 3),
                     "slowdown_pct": round(100 * (1 - tok_s["json_schema"] / tok_s["unconstrained"]), 1)})
    report.emit(_mask_cost(engine, outs))
    engine.shutdown()


def _mask_cost(engine, outs) -> dict:
    """Microseconds per token to fill one request's bitmask (replaying a real constrained
    output through a fresh matcher) and to apply a batch-16 bitmask to its logits."""
    import torch

    from radixlm.srt.constrained.spec import GrammarSpec

    cache = engine.scheduler.constraints.cache
    compiled = cache.submit(GrammarSpec("json_schema", json.dumps(LONG_ARRAY))).future.result()
    backend = cache.backend
    bitmask = backend.allocate_bitmask(16)
    fill_s, tokens = 0.0, 0
    for out in outs:
        matcher = backend.new_matcher(compiled)
        for token in out["output_ids"]:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            fill_s += time.perf_counter() - start
            assert matcher.accept_token(token)
            tokens += 1
    logits = torch.randn(16, engine.model_config.vocab_size)
    rows = list(range(16))
    start = time.perf_counter()
    for _ in range(200):
        backend.apply_bitmask(logits, bitmask, rows)
    apply_us = (time.perf_counter() - start) / 200 * 1e6
    return {"bench": "constrained_mask_cost", "tokens": tokens, "fill_us_per_token": round(fill_s / tokens * 1e6, 2),
            "apply_us_per_batch16": round(apply_us, 1), "apply_us_per_token": round(apply_us / 16, 2)}


NOTES = [
    "Hi, this is Dana. Please send 3 boxes of green tea, fast shipping if you can.",
    "Mr. Okafor wants twelve ceramic mugs, no rush.",
    "Order from Lea: 1 standing desk. She needs it by tomorrow!",
    "Paul asks for 250 envelopes, regular delivery is fine.",
    "Send Ines two office chairs by express courier.",
    "Tom would like 40 notebooks; standard post is OK.",
    "Aiko: 6 bags of coffee beans, urgent please.",
    "Please ship 15 printer cartridges to Sven, no hurry.",
]
ORDER = {"type": "object",
         "properties": {"customer_name": {"type": "string", "maxLength": 40},
                        "item_description": {"type": "string", "maxLength": 40},
                        "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 1000},
                        "express_shipping": {"type": "boolean"},
                        "order_status": {"enum": ["received", "pending_review"]}},
         "required": ["customer_name", "item_description", "quantity_ordered", "express_shipping", "order_status"]}


def bench_jump(args, report: Reporter) -> None:
    import radixlm as sgl

    @sgl.function
    def extract(s, note):
        s += sgl.user(f"Note: {note}\nReturn the order as JSON.")
        s += sgl.assistant(sgl.gen("order", json_schema=ORDER, max_tokens=120))

    results = {}
    for name, extra in (("jump_forward_off", {"disable_jump_forward": True}), ("jump_forward_on", {})):
        runtime = sgl.Runtime(max_total_tokens=16384, **extra)
        try:
            batch = [{"note": n} for n in NOTES]
            extract.run_batch(batch[:1], backend=runtime, temperature=0)  # warm-up: compile, prefix
            times, tokens = [], 0
            for _ in range(args.runs):
                states, seconds = timed(extract.run_batch, batch, backend=runtime, temperature=0,
                                        num_threads=len(batch))
                times.append(seconds)
                tokens = sum(s.get_meta_info("order")["completion_tokens"] for s in states)
                for s in states:
                    json.loads(s["order"])
            results[name] = (statistics.median(times), tokens)
        finally:
            runtime.shutdown()
    (off_s, off_tokens), (on_s, on_tokens) = results["jump_forward_off"], results["jump_forward_on"]
    report.emit({"bench": "jump_forward", "programs": len(NOTES), "runs": args.runs,
                 "off_s": round(off_s, 3), "on_s": round(on_s, 3), "off_output_tokens": off_tokens,
                 "on_output_tokens": on_tokens, "baseline": "jump_forward_off", "speedup": round(off_s / on_s, 3)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["decode", "jump", "all"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    report = Reporter(args.out)
    report.emit({"bench": "constrained", "command": command_line(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if args.which in ("decode", "all"):
        bench_decode(args, report)
    if args.which in ("jump", "all"):
        bench_jump(args, report)


if __name__ == "__main__":
    main()
