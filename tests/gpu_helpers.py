"""Small random Llama models and the Llama-3 tokenizer for the GPU tests."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.models import LLAMA3_TOKENIZER_GGUF


def llama3_tokenizer_path() -> str:
    """The Llama-3 tokenizer as an HF directory: the repository's vocab-only GGUF, converted
    into the project's cache on first use (later calls, and servers given it, read the cache)."""
    from radixlm.srt.executor.gguf_loader import convert_gguf_tokenizer

    return str(convert_gguf_tokenizer(LLAMA3_TOKENIZER_GGUF))


def small_llama_config(tmp_dir: Path, num_layers: int = 4) -> str:
    """A 4-layer Llama with the Llama-3 vocabulary and head_dim 128 (the 8B model's kernels)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "vocab_size": 128256, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    }
    path = Path(tmp_dir) / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(out: dict, pos: int) -> float:
    """Logprob margin between the best and second-best token at output position `pos`."""
    top = out["meta_info"]["output_top_logprobs"][pos]
    return top[0][0] - top[1][0]


# bf16 rounding may flip a greedy pick where the two best tokens are this close (logprob units);
# anywhere else a divergence is a bug.
NEAR_TIE = 0.05


def assert_same_greedy(reference: list[dict], other: list[dict]) -> None:
    """Greedy outputs agree, except after a near tie in the reference (which carries top-2
    logprobs); at least half of them agree exactly."""
    exact = 0
    for ref, got in zip(reference, other):
        pos = first_divergence(ref["output_ids"], got["output_ids"])
        if pos is None:
            exact += 1
            continue
        gap = top2_gap(ref, pos)
        assert gap < NEAR_TIE, f"outputs diverge at token {pos} where the reference margin is {gap:.3f}"
    assert exact >= len(reference) // 2, f"only {exact}/{len(reference)} outputs agree exactly"


def cuda_batch(mode, rows, prefix_lens, extend_lens, out_slots, device: str = "cuda"):
    """A ForwardBatch on the GPU (or `device`) for attention-level tests: request `rows` extend
    their cached `prefix_lens` by `extend_lens` tokens whose K/V go to `out_slots`; every row
    keeps logits."""
    import torch

    from radixlm.srt.executor.forward_batch import ForwardBatch

    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    positions = [p + i for p, e in zip(prefix_lens, extend_lens) for i in range(e)]
    dev = torch.device(device)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(len(positions), dtype=torch.int64, device=dev),
        positions=torch.tensor(positions, device=dev), out_cache_loc=torch.tensor(out_slots, device=dev),
        req_pool_indices=torch.tensor(rows, device=dev), req_pool_indices_cpu=list(rows),
        seq_lens=torch.tensor(seq_lens, device=dev), seq_lens_cpu=seq_lens, prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens), logit_rows=torch.arange(len(positions), device=dev))
