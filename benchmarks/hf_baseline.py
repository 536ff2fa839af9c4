"""The HF transformers baseline: batched greedy `generate` on the same token-id prompts.

For the serving benchmark (`run_hf`, CPU): same weights as the server (the converted HF
directory of the model loader), fp32, left padding with an attention mask, `min_new_tokens =
max_new_tokens` so every row produces exactly its output length. Requests are batched
`batch_size` at a time (all at once by default); a batch generates the longest output length
in it, but only the requested tokens count as output, so mixed output lengths are sorted into
batches of equal lengths first. Multi-turn workloads run turn by turn, each turn's prompts
built from HF's own answers.

For the GPU benchmarks (`hf_generate_seconds`): bf16, random weights from a config, one
left-padded batch run to its longest output.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from .serving_datasets import Workload

logger = logging.getLogger("bench.hf_baseline")


def load_hf_model(model_path: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    from radixlm.srt.executor.model_loader import load_model

    local_dir = load_model(model_path, with_weights=False).local_dir
    return AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32).eval()


def _generate_batch(model, prompts: list[list[int]], new_len: int, pad_id: int) -> list[list[int]]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_len,
                             min_new_tokens=new_len, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def warm_up(model, pad_id: int, token_id: int) -> None:
    _generate_batch(model, [[token_id] * 8, [token_id] * 4], 4, pad_id)


def run_hf(model, workload: Workload, batch_size: int | None, pad_id: int,
           deadline: float | None = None) -> dict[str, Any]:
    """Generates the whole workload; returns timing and token counts (model load excluded)."""
    convs = workload.conversations
    answers: list[list[list[int]]] = [[] for _ in convs]
    num_turns = max(len(c.turns) for c in convs)
    prompt_tokens = output_tokens = padded_prompt_tokens = num_batches = 0
    batch_seconds: list[float] = []
    start = time.perf_counter()
    for turn in range(num_turns):
        live = [i for i, c in enumerate(convs) if turn < len(c.turns)]
        live.sort(key=lambda i: convs[i].turns[turn].output_len)  # stable: equal lengths keep order
        size = batch_size or len(live)
        for lo in range(0, len(live), size):
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError("HF baseline passed the run-time cap")
            rows = live[lo:lo + size]
            prompts = [convs[i].prompt_ids(turn, answers[i]) for i in rows]
            wanted = [convs[i].turns[turn].output_len for i in rows]
            t0 = time.perf_counter()
            outs = _generate_batch(model, prompts, max(wanted), pad_id)
            batch_seconds.append(time.perf_counter() - t0)
            for i, out, n in zip(rows, outs, wanted):
                answers[i].append(out[:n])
            prompt_tokens += sum(len(p) for p in prompts)
            padded_prompt_tokens += len(prompts) * max(len(p) for p in prompts)
            output_tokens += sum(wanted)
            num_batches += 1
            logger.info("HF batch %d: %d rows, %.1fs", num_batches, len(rows), batch_seconds[-1])
    duration = time.perf_counter() - start
    num_requests = workload.num_requests
    return {
        "num_requests": num_requests, "completed": num_requests, "failed": 0,
        "duration_s": round(duration, 3),
        "prompt_tokens": prompt_tokens, "padded_prompt_tokens": padded_prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / duration, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / duration, 2),
        "req_s": round(num_requests / duration, 3),
        "hf_batch_size": batch_size or "all", "hf_num_batches": num_batches,
        "hf_batch_s_max": round(max(batch_seconds), 3),
    }


def hf_generate_seconds(config_dir: Path, prompts: list[list[int]], out_lens: list[int], attn: str = "sdpa") -> float:
    """Seconds HF `generate` (bf16, random weights, on the GPU) takes for `prompts` in one
    left-padded batch, run to the longest output (warmed up first; the model is freed after)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).eval()
    num, width, new = len(prompts), max(len(p) for p in prompts), max(out_lens)
    ids = torch.zeros((num, width), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        model.generate(input_ids=ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds
