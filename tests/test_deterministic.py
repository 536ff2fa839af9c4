"""--enable-deterministic-inference on the default model (CPU): a request's tokens and logprobs
do not depend on its batch companions, on the prefill chunk size, on whether its prefix was
cached, partly cached or cold (or made by decoding), nor on the batch size of a log-likelihood
run. The first two are also checked to fail without the flag (so the tests can fail). The
third shows no variation on CPU without the flag (each prompt's prefill there has a shape of
its own whatever the batch); on the H200 it does (test_gpu_deterministic.py).
"""

from __future__ import annotations

import random

import pytest

from radixlm.srt import Engine

GREEDY = {"max_new_tokens": 4, "temperature": 0}
SEEDED = {"max_new_tokens": 4, "temperature": 1.0, "seed": 1234}
PROMPT = "The capital of France is Paris. Write a short story about a dragon:"


@pytest.fixture(scope="module")
def det_engine():
    eng = Engine(enable_deterministic_inference=True, max_total_tokens=16384)
    yield eng
    eng.shutdown()


def _companions(seed: int) -> list[str]:
    """0 to 15 other prompts of different lengths, as in a busy server's batch."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(["red", "tree", "seven", "walked", "over", "the"]) for _ in range(rng.randint(1, 40)))
            for _ in range(rng.randint(0, 15))]


def _answers_beside_companions(engine: Engine, trials: int) -> tuple[set, set]:
    """(distinct (text, logprobs) of the greedy run, and of the seeded run) over the trials."""
    greedy, seeded = set(), set()
    for trial in range(trials):
        others = _companions(trial)
        half = len(others) // 2
        prompts = others[:half] + [PROMPT, PROMPT] + others[half:]
        params = [GREEDY] * half + [GREEDY, SEEDED] + [GREEDY] * (len(others) - half)
        out = engine.generate(prompts, params, return_logprob=True)
        for found, result in ((greedy, out[half]), (seeded, out[half + 1])):
            lps = tuple(lp for lp, _tok, *_ in result["meta_info"]["output_token_logprobs"])
            found.add((result["text"], lps))
    return greedy, seeded


def test_companions_do_not_change_the_answer(det_engine):
    greedy, seeded = _answers_beside_companions(det_engine, 50)
    assert len(greedy) == 1, greedy
    assert len(seeded) == 1, seeded


def test_without_the_flag_companions_change_the_logprobs(engine):
    greedy, seeded = _answers_beside_companions(engine, 8)
    assert len(greedy) > 1 or len(seeded) > 1


def _long_prefix(engine: Engine) -> list[int]:
    text = " ".join(f"item{i} weighs {i * 7 % 13} kg." for i in range(400))
    return engine.tokenizer.encode(text)[:1500]


def _score(engine: Engine, ids: list[int]) -> tuple:
    """Greedy tokens with their logprobs, and the logprobs of the prompt's last 20 tokens."""
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=len(ids) - 20)
    meta = out["meta_info"]
    return _frozen(meta["output_token_logprobs"]), _frozen(meta["input_token_logprobs"])


def _frozen(logprobs: list) -> tuple:
    return tuple(tuple(entry) for entry in logprobs)


ALL_CASES = ("cold", "cached", "partly cached", "decoded prefix cached", "decoded prefix cold")


def _prefix_cases(engine: Engine, names: tuple[str, ...] = ALL_CASES) -> dict[str, tuple]:
    """The same prompt (a 1500-token prefix and a question) scored cold, with its prefix cached,
    with part of it cached; and a prompt whose prefix holds 8 tokens the engine generated, with
    their KV from that decode or cold."""
    prefix = _long_prefix(engine)
    question = engine.tokenizer.encode(" Question: how much does item5 weigh? Answer:")
    cases = {}
    engine.flush_cache()
    cases["cold"] = _score(engine, prefix + question)
    if "cached" in names:
        cases["cached"] = _score(engine, prefix + question)
    if "partly cached" in names:
        engine.flush_cache()
        engine.generate(input_ids=prefix[:700], sampling_params={"max_new_tokens": 1})
        cases["partly cached"] = _score(engine, prefix + question)
    if "decoded prefix cached" in names:
        engine.flush_cache()
        made = engine.generate(input_ids=prefix[:900], sampling_params={"max_new_tokens": 8, "temperature": 0})
        follow_up = prefix[:900] + made["output_ids"] + question
        cases["decoded prefix cached"] = _score(engine, follow_up)
        engine.flush_cache()
        cases["decoded prefix cold"] = _score(engine, follow_up)
    return cases


def test_cached_and_chunked_prefixes_give_the_same_answer(det_engine):
    cases = {f"whole, {name}": value for name, value in _prefix_cases(det_engine).items()}
    for chunk, names in ((64, ("cold", "partly cached")), (256, ("cold",))):
        eng = Engine(enable_deterministic_inference=True, max_total_tokens=8192, chunked_prefill_size=chunk)
        try:
            cases.update({f"chunks of {chunk}, {name}": value for name, value in _prefix_cases(eng, names).items()})
        finally:
            eng.shutdown()
    assert_one_answer_per_prompt(cases)


def assert_one_answer_per_prompt(cases: dict[str, tuple]) -> None:
    """The prefix prompt's cases all agree, and so do the decoded-prefix prompt's."""
    plain = {name: value for name, value in cases.items() if "decoded" not in name}
    decoded = {name: value for name, value in cases.items() if "decoded" in name}
    assert len(set(plain.values())) == 1, sorted(plain)
    assert len(set(decoded.values())) == 1, sorted(decoded)


def test_without_the_flag_a_cached_prefix_changes_the_logprobs(engine):
    cases = _prefix_cases(engine)
    assert len({cases["cold"], cases["partly cached"]}) == 2
    assert len({cases["decoded prefix cached"], cases["decoded prefix cold"]}) == 2


def test_requests_sharing_a_cached_prefix_do_not_change_the_answer(det_engine):
    """Six questions after one cached 600-token prefix decode together, reading its KV blocks
    once for all six (attention/deterministic.py, _SharedBlocks); each answer is the one it
    gets alone and cold."""
    prefix = _long_prefix(det_engine)[:600]
    prompts = [prefix + det_engine.tokenizer.encode(f" Question {i}: how much does item{i} weigh? Answer:")
               for i in range(6)]
    options = {"sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": len(prefix)}
    alone = []
    for prompt in prompts[:2]:
        det_engine.flush_cache()
        alone.append(det_engine.generate(input_ids=prompt, **options)["meta_info"])
    det_engine.flush_cache()
    det_engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
    together = det_engine.generate(input_ids=prompts, **options)
    for meta, result in zip(alone, together):
        assert result["meta_info"]["cached_tokens"] >= 512
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert result["meta_info"][key] == meta[key]


def _loglikelihoods(engine: Engine, batch_size: int) -> list[tuple]:
    """An lm-evaluation-harness-style run: 32 few-shot contexts with a continuation each, the
    continuation's token logprobs scored in batches of `batch_size`."""
    shots = "Q: 2+2? A: 4\nQ: 3+5? A: 8\nQ: 7+1? A: 8\n"
    requests = [(f"{shots}Q: {i}+{i % 5}? A:", f" {i + i % 5}") for i in range(32)]
    scores = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        contexts = [engine.tokenizer.encode(c) for c, _ in chunk]
        full = [ctx + engine.tokenizer.encode(cont) for ctx, (_, cont) in zip(contexts, chunk)]
        out = engine.generate(input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        scores += [tuple(r["meta_info"]["input_token_logprobs"]) for r in out]
    return scores


def test_loglikelihood_scores_do_not_depend_on_the_batch_size(det_engine):
    det_engine.flush_cache()
    one = _loglikelihoods(det_engine, 1)
    det_engine.flush_cache()
    assert _loglikelihoods(det_engine, 32) == one


def test_requests_without_a_seed_sample_the_same_answer(det_engine):
    """The flag gives every request the server's seed, and sample i of n the seed + i."""
    params = {"max_new_tokens": 8, "temperature": 1.0}
    first = det_engine.generate(PROMPT, params)["text"]
    assert det_engine.generate(PROMPT, params)["text"] == first
    pair = det_engine.generate(PROMPT, {**params, "n": 2})
    assert pair[0]["text"] == first and pair[1]["text"] != first


def test_a_model_it_cannot_make_invariant_is_refused_by_name(tmp_path):
    from radixlm.srt.executor.batch_invariant import make_batch_invariant
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="enable_deterministic_inference: not implemented on mps"):
        make_batch_invariant(model, torch.device("mps"))
    model[0].weight.data = model[0].weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 weights"):
        make_batch_invariant(model, torch.device("cpu"))
