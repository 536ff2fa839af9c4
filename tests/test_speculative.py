"""Speculative decoding with n-gram drafts (`--speculative-algorithm ngram`) on the default model:
greedy output exactly as without it, fewer verify forwards than tokens where the output copies
the prompt, no KV leaked by rejected drafts or aborts, and rejection sampling that keeps the
model's distribution."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.srt.executor.speculative import verify_drafts
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.scheduler.draft_pacing import DraftPacing
from radixlm.srt.scheduler.ngram import TokenHistory, propose_ngram
from radixlm.srt.core.request import Req

DOC = ("Invoice 4471. Customer: Maria Lopez, 12 Harbor Street, Lisbon. Items: 3 blue chairs at 45 euros, "
       "1 oak table at 300 euros. Total: 435 euros. Due date: 14 March 2026.")
COPY = f"<|im_start|>user\nRepeat this text exactly:\n{DOC}<|im_end|>\n<|im_start|>assistant\n{DOC[:20]}"
PROMPTS = [COPY, "The capital of France is", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]


@pytest.fixture(scope="module")
def spec_engine():
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=8192, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    yield eng
    eng.shutdown()


def run_reqs(engine, prompts, max_new_tokens=40):
    sched = engine.scheduler
    reqs = [Req(rid=f"spec-{i}", origin_input_ids=engine.tokenizer.encode(p, add_special_tokens=False),
                sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
            for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add_request(req)
    while sched.has_work:
        sched.step()
    return reqs


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # "1 2" seen before, followed by 3 9 1
    assert propose_ngram([5, 6, 7], 2) == []
    assert propose_ngram([4, 4, 4], 2, max_match=2) == [4]  # latest earlier match, what follows it
    assert propose_ngram([1, 2, 1, 2, 1, 2], 4) == [1, 2]


def _ngram_by_definition(tokens, num_drafts, max_match, min_match, window):
    """The longest suffix (max_match..min_match tokens) seen before, starting in the window:
    what followed its latest earlier occurrence."""
    n = len(tokens)
    for size in range(min(max_match, n - 1), min_match - 1, -1):
        found = [p for p in range(max(0, n - window), n - size) if tokens[p:p + size] == tokens[n - size:]]
        if found:
            return tokens[found[-1] + size:found[-1] + size + num_drafts]
    return []


def test_ngram_search_matches_its_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randrange(60))]
        num, max_match = rng.randrange(1, 6), rng.randrange(1, 6)
        min_match, window = rng.randrange(1, max_match + 1), rng.choice([4, 10, 4096])
        want = _ngram_by_definition(tokens, num, max_match, min_match, window) if len(tokens) > min_match else []
        assert propose_ngram(tokens, num, max_match, min_match, window) == want, (tokens, num, max_match, min_match)


def test_token_history_follows_appends_and_a_replaced_newest_token():
    history, prompt, output = TokenHistory(), [7, 8, 9], []
    assert history.sync(prompt, output).tolist() == prompt
    for token in range(12):
        output.append(token % 5)
        assert history.sync(prompt, output).tolist() == prompt + output
    output[-1:] = [30, 31, 32]  # jump-forward: the newest token replaced by the forced ones
    assert history.sync(prompt, output).tolist() == prompt + output
    output.append(4)
    assert history.sync(prompt, output).tolist() == prompt + output


def pauses(pacing: DraftPacing, outcomes) -> list[int]:
    """The pause after each outcome: a verify step's accepted drafts, or None for no draft."""
    got = []
    for accepted in outcomes:
        pacing.no_draft() if accepted is None else pacing.verified(accepted)
        got.append(pacing.backoff)
        while not pacing.due:
            pacing.skipped()
    return got


def test_drafting_pauses_double_while_it_does_not_pay():
    pacing = DraftPacing()
    assert pauses(pacing, [0, 0, 0, 0, 0, 0, 0]) == [4, 8, 16, 32, 64, 64, 64]
    # After a pause a step is judged on its own; one that pays (a draft accepted) forgets the
    # failures, and the running average carries a bad step after a good one.
    assert pauses(pacing, [1, 0, 4, 0, 0, 0]) == [0, 4, 0, 0, 4, 8]
    # Nothing to draft costs no verify forward: no pause at first, then 1, 2, 4, ... up to 16.
    assert pauses(pacing, [None] * 8) == [0, 1, 2, 4, 8, 16, 16, 16]
    assert pauses(pacing, [2, None, None]) == [0, 0, 1]


def test_greedy_output_is_unchanged_and_copying_takes_fewer_forwards(engine, spec_engine):
    plain = run_reqs(engine, PROMPTS)
    fast = run_reqs(spec_engine, PROMPTS)
    for a, b in zip(plain, fast):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.spec_verify_ct == 0
    copy = fast[0]
    assert copy.spec_accepted > 0 and copy.spec_verify_ct < len(copy.output_ids), \
        (copy.spec_verify_ct, copy.spec_accepted, len(copy.output_ids))
    stats = spec_engine.scheduler.kv_stats()
    assert stats["leaked"] == 0 and stats["held_by_requests"] == 0


def test_engine_generate_with_speculation_matches(engine, spec_engine):
    params = {"temperature": 0, "max_new_tokens": 24, "stop": ["Total"]}
    fast = spec_engine.generate(PROMPTS, params)
    assert [o["text"] for o in fast] == [o["text"] for o in engine.generate(PROMPTS, params)]
    assert fast[0]["meta_info"]["spec_verify_ct"] > 0


def test_a_logit_bias_is_honoured_while_other_requests_speculate(engine, spec_engine):
    """Drafts are verified against unbiased logits, so a request with a logit bias decodes without
    them: banning the copy's most frequent token changes its output as on a plain engine."""
    plain = engine.generate(COPY, {"temperature": 0, "max_new_tokens": 32})["output_ids"]
    common = max(set(plain), key=plain.count)
    params = {"temperature": 0, "max_new_tokens": 32, "logit_bias": {str(common): -100}}
    biased = spec_engine.generate([COPY, COPY], [params, {"temperature": 0, "max_new_tokens": 32}])
    assert common not in biased[0]["output_ids"]
    assert biased[0]["output_ids"] == engine.generate(COPY, params)["output_ids"]
    assert "spec_verify_ct" not in biased[0]["meta_info"]  # reported only when it speculated
    assert biased[1]["output_ids"] == plain and biased[1]["meta_info"]["spec_verify_ct"] > 0


def test_chat_drafts_seldom_and_its_plain_steps_overlap(engine, spec_engine):
    """Ordinary chat copies little: drafting pauses, and the decode steps in which no one
    drafts run overlapped (here forced on, as on a GPU). Greedy output as without speculation."""
    prompt = "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    sched = spec_engine.scheduler
    before = sched.server_info()["overlap"]
    sched.overlap = True
    try:
        out = spec_engine.generate(prompt, params)
    finally:
        sched.overlap = False
    after = sched.server_info()["overlap"]
    assert out["output_ids"] == engine.generate(prompt, params)["output_ids"]
    verify_ct = out["meta_info"]["spec_verify_ct"]
    assert 0 < verify_ct <= 48 // 6, verify_ct
    steps = after["steps"] - before["steps"]
    assert after["overlapped_steps"] - before["overlapped_steps"] >= steps // 3, (before, after)
    assert sched.kv_stats()["leaked"] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_mid_speculation_leaks_nothing(page_size):
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=4096, page_size=page_size, speculative_algorithm="ngram")
    try:
        sched = eng.scheduler
        req = Req(rid="abort-me", origin_input_ids=eng.tokenizer.encode(COPY, add_special_tokens=False),
                  sampling_params=SamplingParams(max_new_tokens=60, temperature=0.0))
        sched.add_request(req)
        while req.spec_verify_ct < 3:
            sched.step()
        assert sched.abort("abort-me") is req
        while sched.has_work:
            sched.step()
        stats = sched.kv_stats()
        assert stats["leaked"] == 0 and stats["protected"] == 0 and stats["held_by_requests"] == 0
        out = eng.generate(COPY, {"temperature": 0, "max_new_tokens": 30})
        assert sched.kv_stats()["leaked"] == 0 and out["meta_info"]["completion_tokens"] == 30
    finally:
        eng.shutdown()


def test_rejection_sampling_keeps_the_distribution():
    """The first token of a verify step is distributed as the model's p, whatever the draft:
    chi-square over 6 tokens, 6000 draws with a fixed seed (critical value 20.5 at p = 0.001)."""
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.3, 0.3, 0.3, 0.3, 0.3, 3.0]])
    p = torch.softmax(logits[0], dim=-1)
    req = Req(rid="r", origin_input_ids=[1], sampling_params=SamplingParams(temperature=1.0, seed=1234))
    counts = torch.zeros(6)
    draws = 6000
    for _ in range(draws):
        out = verify_drafts(req, logits, [2])
        counts[out[0]] += 1
        assert len(out) in (1, 2) and (len(out) == 1 or out[0] == 2)
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())
    # A draft the model finds likely is accepted about as often as p says.
    assert abs(counts[2] / draws - float(p[2])) < 0.03


def test_server_reports_verify_forwards_and_accepted_length(server):
    """meta_info.spec_verify_ct (SGLang's name) per request, the mean accepted length in
    /metrics and /get_server_info; greedy text as the plain server's."""
    from benchmarks.harness import ServerProcess

    body = {"text": COPY, "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    plain = server.client().post("/generate", json=body).json()
    spec = ServerProcess("--max-total-tokens", "8192", "--speculative-algorithm", "NGRAM")
    try:
        with spec.client() as client:
            def verify_steps() -> float:  # the warm-up request at start counts too
                return float(next(line.split()[-1] for line in client.get("/metrics").text.splitlines()
                                  if line.startswith("radixlm_spec_verify_steps_total")))

            before = verify_steps()
            out = client.post("/generate", json=body).json()
            assert out["text"] == plain["text"] and "spec_verify_ct" not in plain["meta_info"]
            assert 0 < out["meta_info"]["spec_verify_ct"] < out["meta_info"]["completion_tokens"]
            assert verify_steps() - before == out["meta_info"]["spec_verify_ct"]
            info = client.get("/get_server_info").json()
            assert info["speculative"]["mean_accepted_length"] > 1.0
    finally:
        spec.stop()


def test_constrained_requests_speculate_through_the_grammar(engine, spec_engine):
    """n-gram drafts are cut at the first token the grammar rejects and each verify row is masked
    by the grammar state after the drafts before it: plain constrained greedy output, fewer
    verify forwards than tokens where the JSON copies the prompt."""
    import json

    schema = {"type": "object", "properties": {"customer": {"type": "string"}, "street": {"type": "string"}},
              "required": ["customer", "street"]}
    prompt = f"<|im_start|>user\n{DOC}\nGive the customer and street as JSON.<|im_end|>\n<|im_start|>assistant\n"
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    fast = spec_engine.generate(prompt, params)
    assert fast["text"] == engine.generate(prompt, params)["text"]
    assert 0 < fast["meta_info"]["spec_verify_ct"] < fast["meta_info"]["completion_tokens"]
    stats = spec_engine.scheduler.kv_stats()
    assert stats["leaked"] == 0 and stats["held_by_requests"] == 0
