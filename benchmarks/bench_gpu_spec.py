"""Speculative decoding on the GPU. One JSON line per result (appended to --out), each with its
baseline measured in the same run.

  verify  Llama-3.1-8B shape, dummy bf16 weights: one verify forward (the newest token and K
          drafts per request, K = 2, 4, 8) at batch 1, 8 and 64, against one plain decode step
          of the same batch (CUDA graph, as the engine runs it), 512 tokens of context each
  ngram   the real default model (--gguf, SmolLM2-135M-Instruct): the n-gram workloads of
          spec_workloads.py (extraction, code edit, chat), one request at a time, greedy:
          mean accepted length and speedup against speculation off, outputs compared
  draft   the same workloads with a draft model: the default model cut to its first
          --draft-layers layers (a cheap draft, few acceptances) and the whole model drafting
          for itself (every draft accepted, no cheaper): acceptance and speedup against off

    python -m benchmarks.bench_gpu_spec --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out benchmarks/results/gpu_h200_spec.jsonl              # all suites, ~5 min on an H200
    python -m benchmarks.bench_gpu_spec --suites verify           # no GGUF needed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from .engine_runs import free_engine
from .gpu_measure import gpu_reporter
from .gpu_workloads import random_prompts
from .harness import Reporter
from .models import LLAMA3_TOKENIZER_GGUF, LLAMA_8B_CONFIG
from .spec_workloads import WORKLOADS, run

CONTEXT_LEN = 512


def verify_cost(engine, rep: Reporter, batch_sizes: list[int], draft_counts: list[int], repeats: int) -> None:
    """Device time of one forward, CUDA events around `repeats` calls, median of 5 rounds."""
    import random

    import torch

    from radixlm.srt.core.request import Req
    from radixlm.srt.core.step import ExtendPlan
    from radixlm.srt.executor.batch_builder import build_decode_batch, build_extend_batch, build_verify_batch
    from radixlm.srt.sampling_params import SamplingParams

    sched = engine.scheduler
    runner, device = sched.engine.runner, sched.engine.device
    rng = random.Random(2)
    most = max(draft_counts)

    def forward_ms(batch) -> float:
        rounds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                runner.forward(batch)
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / repeats)
        return statistics.median(rounds)

    for bs in batch_sizes:
        # Requests with CONTEXT_LEN tokens of (unwritten: attention cost depends on lengths only)
        # KV, their newest token, and slots for the most drafts after it.
        reqs, owned = [], []
        for prompt in random_prompts(rng, [CONTEXT_LEN] * bs):
            req = Req(rid="verify", origin_input_ids=prompt, sampling_params=SamplingParams(), output_ids=[prompt[-1]])
            req.req_pool_idx = sched.req_table.alloc()
            slots = sched.allocator.alloc(0, CONTEXT_LEN + 1 + most, None)
            sched.req_table.table[req.req_pool_idx, :len(slots)] = slots
            reqs.append(req)
            owned.append(slots)
        try:
            row = lambda r: list(sched.req_table.table[r.req_pool_idx, CONTEXT_LEN:CONTEXT_LEN + 1 + most])  # noqa: E731
            decode = build_decode_batch([ExtendPlan(r, CONTEXT_LEN, 1, row(r)[:1], CONTEXT_LEN, 1) for r in reqs],
                                        device)
            decode_ms = forward_ms(decode)
            for k in draft_counts:
                parts = [ExtendPlan(r, CONTEXT_LEN, 1 + k, row(r)[:1 + k], CONTEXT_LEN, 1 + k,
                                    drafts=[rng.randrange(1000, 128000) for _ in range(k)]) for r in reqs]
                # As the engine runs it: one decode row per token (CUDA graphs up to --cuda-graph-max-bs
                # rows); and as one eager extend forward, for comparison.
                verify_ms = forward_ms(build_verify_batch(parts, device))
                extend_ms = forward_ms(build_extend_batch(parts, device))
                rep.emit({"bench": "gpu_spec_verify_cost", "model": "llama-3.1-8b shape, dummy bf16", "batch": bs,
                          "drafts": k, "context_tokens": CONTEXT_LEN, "verify_forward_ms": round(verify_ms, 3),
                          "verify_rows": bs * (1 + k), "as_extend_forward_ms": round(extend_ms, 3),
                          "baseline": "one decode step, same batch (CUDA graph)", "decode_step_ms": round(decode_ms, 3),
                          # Also the mean accepted length at which speculation (drafts aside) breaks even.
                          "verify_vs_decode": round(verify_ms / decode_ms, 3)})
        finally:
            for req, slots in zip(reqs, owned):
                sched.allocator.free(slots)
                sched.req_table.free(req.req_pool_idx)


def truncated_copy(local_dir: str, layers: int) -> str:
    """An HF directory holding the model cut to its first `layers` layers (its other tensors
    are read and ignored): the draft model of the draft suite."""
    folder = tempfile.mkdtemp(prefix=f"draft{layers}-")
    for name in os.listdir(local_dir):
        if name != "config.json":
            os.symlink(os.path.join(local_dir, name), os.path.join(folder, name))
    config = json.loads(Path(local_dir, "config.json").read_text())
    config["num_hidden_layers"] = layers
    Path(folder, "config.json").write_text(json.dumps(config))
    return folder


def compare(rep: Reporter, plain, spec, label: dict, workloads: list[str], runs: int, max_new: int) -> None:
    """Each workload on both engines, runs alternating, medians; the line reports the speedup."""
    sched = spec.scheduler
    for name in workloads:
        prompts = WORKLOADS[name]
        run(plain, prompts[:1], 4)
        run(spec, prompts[:1], 4)
        steps0, accepted0 = sched.spec_verify_steps, sched.spec_accepted_tokens
        ours, base = [], []
        for _ in range(runs):
            seconds, spec_ids = run(spec, prompts, max_new)
            ours.append(seconds)
            seconds, plain_ids = run(plain, prompts, max_new)
            base.append(seconds)
        steps, accepted = sched.spec_verify_steps - steps0, sched.spec_accepted_tokens - accepted0
        rep.emit({"bench": "gpu_spec_workload", **label, "workload": name, "requests": len(prompts), "batch": 1,
                  "output_tokens": sum(len(ids) for ids in plain_ids),
                  "mean_accepted_length": round(1 + accepted / steps, 3) if steps else None,
                  # bf16: a verify forward's logits differ from a decode step's in the last bits,
                  # so a near-tie can go the other way; greedy outputs are identical in fp32 (CPU tests).
                  "same_outputs": sum(a == b for a, b in zip(spec_ids, plain_ids)),
                  "ours_s": round(statistics.median(ours), 3), "baseline": "same engine settings, no speculation",
                  "baseline_s": round(statistics.median(base), 3),
                  "speedup": round(statistics.median(base) / statistics.median(ours), 3),
                  "goal": {"extraction": ">= 1.5", "chat": ">= 0.95"}.get(name, "report")
                  if label["algorithm"] == "ngram" else "report"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="verify,ngram,draft")
    parser.add_argument("--out", default=None)
    parser.add_argument("--gguf", default=None, help="the default model's GGUF (ngram and draft suites)")
    parser.add_argument("--tokenizer-path", default=None, help="Llama-3 tokenizer (verify suite)")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--draft-counts", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--workloads", default="extraction,code_edit,chat")
    args = parser.parse_args()
    suites = set(args.suites.split(","))
    unknown = suites - {"verify", "ngram", "draft"}
    if unknown:
        parser.error(f"unknown suites: {', '.join(sorted(unknown))}")
    if suites & {"ngram", "draft"} and not args.gguf:
        parser.error("--gguf PATH is needed by the ngram and draft suites")
    rep = gpu_reporter(args.out)
    from radixlm.srt import Engine

    if "verify" in suites:
        tokenizer = args.tokenizer_path or str(LLAMA3_TOKENIZER_GGUF)
        engine = Engine(str(LLAMA_8B_CONFIG), load_format="dummy", tokenizer_path=tokenizer, max_running_requests=512,
                        disable_overlap_schedule=True)
        verify_cost(engine, rep, [int(b) for b in args.batch_sizes.split(",")],
                    [int(k) for k in args.draft_counts.split(",")], args.repeats)
        free_engine(engine)
    workloads = args.workloads.split(",")
    common = {"max_total_tokens": 65536}
    if suites & {"ngram", "draft"}:
        plain = Engine(args.gguf, **common)
    if "ngram" in suites:
        spec = Engine(args.gguf, speculative_algorithm="ngram", speculative_num_draft_tokens=args.draft_tokens, **common)
        compare(rep, plain, spec, {"algorithm": "ngram", "drafts": args.draft_tokens}, workloads, args.runs,
                args.max_new_tokens)
        free_engine(spec)
    if "draft" in suites:
        local_dir = _local_dir(args.gguf)
        for layers, path in ((args.draft_layers, truncated_copy(local_dir, args.draft_layers)), (None, args.gguf)):
            spec = Engine(args.gguf, speculative_algorithm="draft", speculative_draft_model_path=path,
                          speculative_num_steps=args.draft_tokens, **common)
            label = {"algorithm": "draft", "drafts": args.draft_tokens,
                     "draft_model": f"first {layers} of 30 layers" if layers else "the target itself"}
            compare(rep, plain, spec, label, workloads, args.runs, args.max_new_tokens)
            free_engine(spec)
    if suites & {"ngram", "draft"}:
        free_engine(plain)


def _local_dir(gguf: str) -> str:
    from radixlm.srt.executor.model_loader import load_model

    return load_model(gguf, with_weights=False).local_dir


if __name__ == "__main__":
    main()
