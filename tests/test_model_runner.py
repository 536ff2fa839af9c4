"""The model runner against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import extend_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def test_logits_match_hf(engine, hf_model):
    worst = 0.0
    for text in PROMPTS:
        ids = _ids(engine, text)
        ours = extend_logits(engine, [[ids]])[0]
        ref = hf_model(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"largest logit difference against HF: {worst:.2e}")
    assert worst < 1e-3


@torch.inference_mode()
def test_greedy_32_tokens_match_hf_generate(engine, hf_model):
    for text in PROMPTS[:2]:
        ids = _ids(engine, text)
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                              "ignore_eos": True})
        assert out["output_ids"] == ref


def test_capital_of_france(engine):
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    assert out["text"].startswith(" Paris")


def test_cached_prefix_extend_equals_full_prefill(engine):
    ids = _ids(engine, PROMPTS[3])
    full = extend_logits(engine, [[ids]])[0]
    for cut in (1, 7, len(ids) - 1):
        chunked = extend_logits(engine, [[ids[:cut], ids[cut:]]])[0]
        assert (chunked - full).abs().max().item() < 1e-3
    three = extend_logits(engine, [[ids[:4], ids[4:9], ids[9:]]])[0]
    assert (three - full).abs().max().item() < 1e-3


def test_batched_extend_equals_solo(engine):
    seqs = [_ids(engine, p) for p in PROMPTS]
    solo = [extend_logits(engine, [[s]])[0] for s in seqs]
    # Different lengths and different cached-prefix lengths in one batch.
    batched = extend_logits(engine, [[s[:3], s[3:]] for s in seqs])
    for a, b in zip(solo, batched):
        assert (a - b).abs().max().item() < 1e-3


def test_batch_generate_equals_solo_generate(engine):
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    solo = [engine.generate(p, params)["output_ids"] for p in PROMPTS]
    batch = engine.generate(PROMPTS, params)
    assert [o["output_ids"] for o in batch] == solo


def test_second_call_reuses_cached_prefix(engine):
    prompt = PROMPTS[3] + " was known for"
    engine.generate(prompt, {"temperature": 0, "max_new_tokens": 2})
    again = engine.generate(prompt + " his kindness", {"temperature": 0, "max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] >= len(_ids(engine, prompt)) - 1


def test_no_kv_leak_after_generation(engine):
    engine.generate(PROMPTS, {"temperature": 0.7, "max_new_tokens": 5})
    stats = engine.scheduler.kv_stats()
    assert stats["leaked"] == 0 and stats["protected"] == 0


@pytest.mark.parametrize("page_size", [4])
def test_page_size_greedy_matches(page_size, default_model):
    from radixlm.srt import Engine

    paged = Engine(page_size=page_size, max_total_tokens=2048)
    try:
        params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
        first = paged.generate(PROMPTS[3], params)
        second = paged.generate(PROMPTS[3], params)  # served from page-aligned cache
        assert first["output_ids"] == second["output_ids"]
        assert second["meta_info"]["cached_tokens"] % page_size == 0
        assert second["meta_info"]["cached_tokens"] > 0
        assert paged.scheduler.kv_stats()["leaked"] == 0
    finally:
        paged.shutdown()


def test_shared_prefix_in_one_batch_is_computed_once(engine):
    """Requests arriving together with a common uncached prefix: one computes it, the others
    wait a step and read it from the cache."""
    engine.flush_cache()
    prefix = "Background: " + " ".join(f"fact number {i} is true." for i in range(40))
    prompts = [prefix + f" Question {q}: is fact {q} true?" for q in range(4)]
    outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 2})
    prefix_len = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and all(c >= prefix_len - 2 for c in cached[1:])


def test_cache_hit_statistics_count_only_admissions(engine):
    """Sharing a prompt at prefill must not count as a cache query: the hit rate is what
    requests really found in the cache."""
    engine.flush_cache()
    engine.scheduler.tree.reset_stats()
    ids = engine.tokenizer.encode("A prompt nobody has sent before, about otters.", add_special_tokens=False)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
    stats = engine.scheduler.tree.stats
    assert stats["hit_tokens"] == 0 and stats["queried_tokens"] == len(ids) - 1
