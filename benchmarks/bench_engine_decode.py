"""Single-stream decode tokens/s: radixlm's Engine against HF transformers `generate`.

Same model (the embedded default), same dtype (fp32 unless --dtype bfloat16), same prompt,
greedy, fixed output length, both measured in this run. Prints one JSON line per system and one
with the ratio.

    python -m benchmarks.bench_engine_decode [--new-tokens 64] [--runs 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from .harness import Reporter, best_seconds, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both systems' weights and activations (bfloat16: CPUs with AVX512-BF16 or AMX)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from radixlm.srt import Engine

    dtype = getattr(torch, args.dtype)
    engine = Engine(max_total_tokens=4096, dtype=args.dtype)
    ids = engine.tokenizer.encode(args.prompt, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(_local_dir(), dtype=dtype).eval()

    n = args.new_tokens
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    # Prefill is a small part at this prompt length; subtract neither, as users see both.
    engine.generate(input_ids=ids, sampling_params=params)  # warm-up
    engine.flush_cache()
    ours = best_seconds(lambda: (engine.generate(input_ids=ids, sampling_params=params), engine.flush_cache()),
                        args.runs)

    prompt = torch.tensor([ids])
    with torch.inference_mode():
        gen = lambda: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        gen()  # warm-up
        theirs = best_seconds(gen, args.runs)

    common = {"prompt_tokens": len(ids), "new_tokens": n, "threads": torch.get_num_threads(), "dtype": args.dtype}
    report = Reporter(None)
    report.emit({"bench": "engine_decode", "system": "hf_transformers_generate", "tok_per_s": round(n / theirs, 2),
                 **common})
    report.emit({"bench": "engine_decode", "system": "radixlm_engine", "tok_per_s": round(n / ours, 2), **common})
    report.emit({"bench": "engine_decode", "baseline": "hf_transformers_generate", "ratio": ratio(theirs, ours),
                 **common})


def _local_dir() -> str:
    from radixlm.srt.executor.model_loader import load_model

    return load_model().local_dir


if __name__ == "__main__":
    main()
