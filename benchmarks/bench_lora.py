"""What serving LoRA adapters costs: the same workloads on an engine with --enable-lora and
adapters mixed over the requests, and on an engine without LoRA (the baseline), both in this run.

Adapters are random PEFT files of the model's shapes on every projection (CPU: 4 of rank 8 on
the default model; GPU: 8 of rank 16 on the Llama-3.1-8B shape, dummy weights). Workloads:
offline throughput with the adapters spread uniformly over the requests (on a GPU
gpu_workloads.offline_workload: 1000 prompts; a scaled-down one on CPU), batch-1 decode
ms/token with an adapter, and the offline workload of base-model requests on the LoRA engine.
Prints one JSON line per engine and workload and one ratio line per workload (LoRA / baseline).

    python -m benchmarks.bench_lora [--out FILE]                  # CPU, default model
    python -m benchmarks.bench_lora --llama8b --tokenizer-path T  # GPU, 8B shape, dummy weights
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
from pathlib import Path

import torch

from .bench_deterministic import SMOLLM_IDS, _seconds, decode_ms
from .gpu_workloads import offline_workload, random_prompts
from .gpu_measure import device_name
from .harness import Reporter, command_line, ratio, run_frame
from .models import add_engine_model_flags, engine_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config, rank: int, seed: int, std: float = 0.02) -> None:
    """A PEFT LoRA adapter of `config`'s shapes on every projection, its weights random."""
    from safetensors.torch import save_file

    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS), "bias": "none"}))


def offline(engine, prompts, out_lens, adapters: list[str | None]) -> dict:
    """Every request in one call, request i on adapters[i % len(adapters)]."""
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in out_lens]
    loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    engine.flush_cache()
    outs = []
    seconds = _seconds(lambda: outs.extend(engine.generate(input_ids=prompts, sampling_params=params,
                                                           lora_path=loras)))
    assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(out_lens)
    engine.flush_cache()
    return {"seconds": round(seconds, 2), "output_tok_s": round(sum(out_lens) / seconds, 1)}


class OnAdapter:
    """An engine whose generate() runs every request on one adapter (for decode_ms)."""

    def __init__(self, engine, adapter: str | None):
        self.engine, self.adapter = engine, adapter

    def generate(self, **kwargs):
        return self.engine.generate(**kwargs, lora_path=self.adapter)

    def flush_cache(self):
        return self.engine.flush_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_model_flags(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs per workload and engine, the engines "
                        "taking turns; the best is kept")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--num-requests", type=int, default=1000, help="GPU: requests of the offline workload")
    args = parser.parse_args()

    from radixlm.srt import Engine

    gpu = torch.cuda.is_available()
    device = device_name()
    frame = run_frame(device)
    report = Reporter(args.out, command=command_line())
    model_args, model = engine_model(args)
    num_adapters, rank = (8, 16) if args.llama8b else (4, 8)
    if gpu:
        prompts, out_lens = offline_workload(num=args.num_requests)
        decode_prompt, decode_lens = random_prompts(random.Random(1), [512])[0], (32, 288)
    else:
        rng = random.Random(0)
        prompts = random_prompts(rng, [rng.randint(64, 192) for _ in range(48)], SMOLLM_IDS)
        out_lens = [rng.randint(16, 48) for _ in range(48)]
        decode_prompt, decode_lens = random_prompts(random.Random(1), [128], SMOLLM_IDS)[0], (8, 72)
    names = [f"adapter{i}" for i in range(num_adapters)]
    described = f"{num_adapters} adapters of rank {rank} on every projection"
    # (engine, workload) -> how to run it; the LoRA engine's base-model run is its own line.
    runs = {
        ("baseline", "offline"): lambda e: offline(e, prompts, out_lens, [None]),
        ("baseline", "batch1_decode"): lambda e: decode_ms(e, decode_prompt, *decode_lens),
        ("lora", "offline"): lambda e: offline(e, prompts, out_lens, names),
        ("lora", "batch1_decode"): lambda e: decode_ms(OnAdapter(e, names[0]), decode_prompt, *decode_lens),
        ("lora", "offline_base_requests"): lambda e: offline(e, prompts, out_lens, [None]),
    }
    results: dict[tuple[str, str], dict] = {}

    def start(label: str, tmp: str):
        if label == "baseline":
            return Engine(**model_args)
        engine = Engine(**model_args, enable_lora=True, max_lora_rank=rank, max_loras_per_batch=num_adapters)
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, engine.model_config, rank, seed=i)
            engine.load_lora_adapter(name, str(Path(tmp) / name))
        return engine

    # On the 2-core CPU both engines stay up and take turns, run by run, so drift of a noisy
    # machine falls on both alike; two 8B engines' KV pools do not fit one GPU side by side,
    # so there they run one after the other, each with the whole card.
    groups = [("baseline",), ("lora",)] if gpu else [("baseline", "lora")]
    for group in groups:
        engines: dict[str, object] = {}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                for label in group:
                    engines[label] = start(label, tmp)
                for _ in range(args.repeats):
                    for (label, workload), run in runs.items():
                        if label not in engines:
                            continue
                        got = run(engines[label])
                        key = next(iter(got))
                        best = results.get((label, workload))
                        if best is None or got[key] < best[key]:
                            results[(label, workload)] = got
            finally:
                for engine in engines.values():
                    engine.shutdown()
                engines.clear()
                gc.collect()
                if gpu:
                    torch.cuda.empty_cache()
        for (label, workload), best in results.items():
            if label in group:
                report.emit({"bench": "lora", "device": device, "model": model, "engine": label,
                             "adapters": described if label == "lora" else None, "workload": workload, **best,
                             **frame})
    base = results
    lines = [("offline", {"throughput_ratio": ratio(base[("lora", "offline")]["output_tok_s"],
                                                   base[("baseline", "offline")]["output_tok_s"])},
              f"requests mixed uniformly over {described}"),
             ("batch1_decode", {"ms_per_token_ratio": ratio(base[("lora", "batch1_decode")]["ms_per_token"],
                                                           base[("baseline", "batch1_decode")]["ms_per_token"])},
              "one adapter of rank %d" % rank),
             ("offline_base_requests", {"throughput_ratio": ratio(base[("lora", "offline_base_requests")]["output_tok_s"],
                                                                  base[("baseline", "offline")]["output_tok_s"])},
              "base-model requests on the --enable-lora engine")]
    for workload, line, what in lines:
        report.emit({"bench": "lora", "device": device, "model": model, "workload": workload, "what": what,
                     "vs": "an engine without --enable-lora on the same requests", **line, **frame})


if __name__ == "__main__":
    main()
