"""Logprobs of chosen tokens, top-k alternatives and prompt tokens (what `select` scores with)."""

from __future__ import annotations

import math

import torch


def test_prompt_logprobs_match_hf(engine, hf_model):
    text = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids
    assert got[0][0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        assert math.isclose(got[pos][0], ref[pos - 1, ids[pos]].item(), abs_tol=1e-3)
    assert out["meta_info"]["completion_tokens"] == 0


def test_logprob_start_len_over_a_cached_prefix(engine):
    prefix = "Question: which planet is known as the red planet? Answer:"
    engine.generate(prefix, {"max_new_tokens": 0})  # warm the cache
    ids = engine.tokenizer.encode(prefix + " Mars", add_special_tokens=False)
    start = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=start)
    scored = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == ids[start:]
    assert all(lp is not None and lp <= 0 for lp, _, _ in scored)
    assert out["meta_info"]["cached_tokens"] > 0
    full = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    for (a, _, _), (b, _, _) in zip(scored, full[start:]):
        assert math.isclose(a, b, abs_tol=1e-3)


def test_output_logprobs_and_top_alternatives(engine):
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 4},
                          return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    chosen = meta["output_token_logprobs"]
    assert [t for _, t, _ in chosen] == out["output_ids"]
    assert chosen[0][2] == " Paris"
    for (lp, tok, _), top in zip(chosen, meta["output_top_logprobs"]):
        assert len(top) == 3
        assert top[0][1] == tok and math.isclose(top[0][0], lp)  # greedy picks the top token
        assert top[0][0] >= top[1][0] >= top[2][0]
