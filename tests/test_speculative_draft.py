"""Speculative decoding with a draft model (`--speculative-algorithm draft`, SGLang's STANDALONE)
on the default model: the same model as its own draft (near-full acceptance, which also shows
the draft's KV is right after chunked prefill and radix-cache hits) and the model cut to two
layers (little acceptance): greedy output exactly as without speculation either way, no KV
leaked, and rejection sampling with the draft's own probabilities keeps the distribution."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from radixlm.srt.executor.draft_model import check_same_vocabulary
from radixlm.srt.executor.model_loader import default_model_path
from radixlm.srt.executor.speculative import verify_drafts
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.core.request import Req
from radixlm.srt.server_args import ServerArgs

DOC = ("Invoice 4471. Customer: Maria Lopez, 12 Harbor Street, Lisbon. Items: 3 blue chairs at 45 euros, "
       "1 oak table at 300 euros. Total: 435 euros. Due date: 14 March 2026.")
LONG = f"<|im_start|>user\nList the fields of this document:\n{DOC}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [LONG, "The capital of France is", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def cut_default_model(folder, **overrides) -> str:
    """The default model with its config changed (e.g. cut to its first layers), as an HF
    directory: a real user path."""
    from radixlm.srt.executor.model_loader import load_model

    source = load_model(with_weights=False).local_dir
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), folder / name)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return str(folder)


@pytest.fixture(scope="module")
def truncated_draft(tmp_path_factory):
    return cut_default_model(tmp_path_factory.mktemp("draft2"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def self_draft_engine():
    """Target and draft are the default model; small prefill chunks, so prompts arrive in parts."""
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=4096, chunked_prefill_size=32, speculative_algorithm="draft",
                 speculative_draft_model_path=default_model_path(), speculative_num_steps=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def weak_draft_engine(truncated_draft):
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=4096, page_size=4, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=truncated_draft, speculative_num_draft_tokens=3)
    yield eng
    eng.shutdown()


def assert_no_leak(engine):
    stats = engine.scheduler.kv_stats()
    assert stats["leaked"] == 0 and stats["held_by_requests"] == 0 and stats["protected"] == 0, stats


def test_flags_are_checked():
    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="x.gguf")
    assert args.speculative.speculative_algorithm == "draft" and args.speculative.drafts_per_step == 4
    assert ServerArgs(speculative_algorithm="DRAFT", speculative_draft_model_path="x",
                      speculative_num_steps=2).speculative.drafts_per_step == 2
    with pytest.raises(ValueError, match="speculative_draft_model_path: required"):
        ServerArgs(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="ngram speculation drafts without a model"):
        ServerArgs(speculative_algorithm="ngram", speculative_draft_model_path="x.gguf")
    with pytest.raises(ValueError, match="'EAGLE' is not implemented"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="x.gguf")
    with pytest.raises(ValueError, match="speculative_num_steps"):
        ServerArgs(speculative_algorithm="draft", speculative_draft_model_path="x", speculative_num_steps=0)


def test_a_draft_with_another_vocabulary_is_refused():
    def model(path, vocab_size, vocab):
        tokenizer = SimpleNamespace(get_vocab=lambda: vocab)
        return SimpleNamespace(model_path=path, config=SimpleNamespace(vocab_size=vocab_size), tokenizer=tokenizer)

    target = model("big.gguf", 4, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="small.gguf.*8 tokens.*big.gguf.*4"):
        check_same_vocabulary(target, model("small.gguf", 8, {"a": 0}))
    with pytest.raises(ValueError, match="small.gguf and the target big.gguf have different tokenizers"):
        check_same_vocabulary(target, model("small.gguf", 4, {"a": 1, "b": 0}))
    check_same_vocabulary(target, model("small.gguf", 4, {"a": 0, "b": 1}))


def test_a_draft_with_a_shorter_context_is_refused(tmp_path):
    from radixlm.srt import Engine

    short = cut_default_model(tmp_path, num_hidden_layers=1, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="reads 1024 tokens of context, fewer than the 8192 served"):
        Engine(max_total_tokens=1024, speculative_algorithm="draft", speculative_draft_model_path=short)
    Engine(max_total_tokens=1024, context_length=1024, speculative_algorithm="draft",
           speculative_draft_model_path=short).shutdown()


def test_self_draft_is_identical_and_accepts_nearly_everything(engine, self_draft_engine):
    """Chunked prefill (32-token chunks) and a radix-cache hit on the second round: the draft's
    KV for the prompt is filled by the same chunks and reused with the target's."""
    plain = engine.generate(PROMPTS, GREEDY)
    fast = self_draft_engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in fast] == [o["output_ids"] for o in plain]
    again = self_draft_engine.generate(LONG, GREEDY)
    assert again["output_ids"] == plain[0]["output_ids"] and again["meta_info"]["cached_tokens"] > 32
    stats = self_draft_engine.scheduler.spec_stats()
    assert stats["algorithm"] == "draft" and stats["mean_accepted_length"] > 4.5, stats
    assert again["meta_info"]["spec_verify_ct"] <= 3
    assert_no_leak(self_draft_engine)


def test_weak_draft_is_identical_with_stops_and_logprobs(engine, weak_draft_engine):
    params = {"temperature": 0, "max_new_tokens": 16, "stop": ["euros"]}
    fast = weak_draft_engine.generate(PROMPTS, params)
    assert [o["text"] for o in fast] == [o["text"] for o in engine.generate(PROMPTS, params)]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in fast)
    assert 1.0 <= weak_draft_engine.scheduler.spec_stats()["mean_accepted_length"] < 3.0
    # Logprob requests decode plainly beside speculating ones, with the same logprobs.
    args = dict(sampling_params={"temperature": 0, "max_new_tokens": 6}, return_logprob=True, top_logprobs_num=2)
    fast = weak_draft_engine.generate(PROMPTS[1], **args)
    slow = engine.generate(PROMPTS[1], **args)
    assert fast["output_ids"] == slow["output_ids"] and "spec_verify_ct" not in fast["meta_info"]
    for (a, ta, _), (b, tb, _) in zip(fast["meta_info"]["output_token_logprobs"],
                                      slow["meta_info"]["output_token_logprobs"]):
        assert ta == tb and abs(a - b) < 1e-3
    assert_no_leak(weak_draft_engine)


@pytest.mark.parametrize("which", ["self", "weak"])
def test_abort_mid_speculation_leaks_nothing(which, request):
    eng = request.getfixturevalue(f"{which}_draft_engine")
    sched = eng.scheduler
    reqs = [Req(rid=f"abort-{i}", origin_input_ids=eng.tokenizer.encode(p, add_special_tokens=False),
                sampling_params=SamplingParams(max_new_tokens=6 if i == 1 else 40, temperature=0.0))
            for i, p in enumerate(PROMPTS)]
    for req in reqs:
        sched.add_request(req)
    while reqs[0].spec_verify_ct < 2:
        sched.step()
    assert sched.abort("abort-0") is reqs[0]
    sched.step()
    assert sched.abort("abort-2") is reqs[2]
    while sched.has_work:
        sched.step()
    assert_no_leak(eng)
    assert eng.flush_cache() and sched.allocator.available_size == sched.allocator.capacity


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_with_draft_probabilities_keeps_the_distribution():
    """Drafts drawn from a draft distribution q far from the target p: each output position is
    distributed as p (chi-square over 6 tokens, 5 degrees of freedom, critical value 20.5 at
    p = 0.001), and drafts are accepted about as often as sum(min(p, q)) says."""
    gen = torch.Generator().manual_seed(7)
    p_logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.3, 0.3, 0.3, 0.3, 0.3, 3.0],
                             [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    p = torch.softmax(p_logits, dim=-1)
    q = torch.softmax(torch.tensor([[0.0, 2.0, 0.0, 1.0, -1.0, 0.5], [1.5, 0.0, 0.0, 0.0, 0.0, 0.0]]), dim=-1)
    req = Req(rid="r", origin_input_ids=[1], sampling_params=SamplingParams(temperature=1.0, seed=1234))
    first, second = torch.zeros(6), torch.zeros(6)
    draws, accepted_first = 6000, 0
    for _ in range(draws):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = verify_drafts(req, p_logits, drafts, q)
        assert 1 <= len(out) <= 3 and out[:len(out) - 1] == drafts[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    assert chi_square(first, p[0]) < 20.5, first.tolist()
    assert chi_square(second, p[1]) < 20.5, second.tolist()
    assert abs(accepted_first / draws - float(torch.minimum(p[0], q[0]).sum())) < 0.03


@pytest.mark.slow
def test_sampling_through_the_draft_model_keeps_the_distribution(engine, weak_draft_engine):
    """End to end at temperature 1, top-k 5: the second output token (the first of a verify step
    whose draft came from the two-layer model) over 200 seeded samples, against 200 of plain
    decoding: a two-sample chi-square over the tokens either saw (critical value at p = 0.001)."""
    prompt = "My favourite colour is"
    n = 200

    def second_tokens(eng, seed0):
        params = [{"temperature": 1.0, "top_k": 5, "max_new_tokens": 3, "seed": seed0 + i, "ignore_eos": True}
                  for i in range(n)]
        return [o["output_ids"][1] for o in eng.generate([prompt] * n, params)]

    before = weak_draft_engine.scheduler.spec_verify_steps
    spec, plain = second_tokens(weak_draft_engine, 0), second_tokens(engine, 10_000)
    assert weak_draft_engine.scheduler.spec_verify_steps - before >= n  # one verify step each at least
    tokens = sorted(set(spec) | set(plain))
    # Rare tokens pooled into one bin, so every expected count is about 5 or more.
    common = [t for t in tokens if spec.count(t) + plain.count(t) >= 10]
    table = torch.tensor([[row.count(t) for t in common] + [sum(row.count(t) for t in tokens if t not in common)]
                          for row in (spec, plain)], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    critical = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9, 10: 29.6}
    assert chi2 < critical.get(dof, 30 + 2 * dof), (chi2, dof, table.tolist())
    assert_no_leak(weak_draft_engine)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "total": {"type": "integer"}}, "required": ["name", "city", "total"]}
CONSTRAINED = [
    (f"<|im_start|>user\n{DOC}\nGive name, city and total as JSON.<|im_end|>\n<|im_start|>assistant\n",
     {"temperature": 0, "max_new_tokens": 32, "json_schema": json.dumps(SCHEMA)}),
    (f"<|im_start|>user\n{DOC}\nWho is the customer?<|im_end|>\n<|im_start|>assistant\n",
     {"temperature": 0, "max_new_tokens": 16, "regex": r"(Maria|Lopez|Lisbon)( [a-z]+){1,8}\."}),
]


@pytest.mark.parametrize("which", ["self", "weak"])
def test_constrained_requests_speculate_with_identical_output(which, engine, request, monkeypatch):
    """Drafts pass through the grammar (drafted under its masks, cut where it ends), each verify
    row is masked by the state after the drafts before it, jump-forward ends a verify step's
    tokens where plain decoding would have jumped: the text is plain constrained greedy's. The
    weak draft's verify steps run as one extend forward (the other form of a verify step)."""
    import radixlm.srt.executor.device_engine as device_engine

    eng = request.getfixturevalue(f"{which}_draft_engine")
    if which == "weak":
        monkeypatch.setattr(device_engine, "VERIFY_AS_DECODE_MAX_ROWS", 0)
    prompts, params = [p for p, _ in CONSTRAINED], [s for _, s in CONSTRAINED]
    fast = eng.generate(prompts, params)
    assert [o["text"] for o in fast] == [o["text"] for o in engine.generate(prompts, params)]
    assert json.loads(fast[0]["text"])["city"] == "Lisbon"
    assert all(o["meta_info"].get("spec_verify_ct", 0) > 0 for o in fast)
    assert_no_leak(eng)


def test_server_with_a_draft_model(engine):
    """`radixlm serve --speculative-algorithm draft --speculative-draft-model-path <GGUF>` over
    HTTP: plain greedy text, verify forwards in meta_info and /get_server_info."""
    from benchmarks.harness import ServerProcess

    srv = ServerProcess("--max-total-tokens", "4096", "--speculative-algorithm", "draft",
                        "--speculative-draft-model-path", default_model_path(), "--speculative-num-steps", "3")
    try:
        with srv.client() as client:
            out = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY}).json()
            assert out["text"] == engine.generate(PROMPTS[1], GREEDY)["text"]
            assert 0 < out["meta_info"]["spec_verify_ct"] <= 4
            info = client.get("/get_server_info").json()["speculative"]
            assert info["algorithm"] == "draft" and info["mean_accepted_length"] >= 3.0
    finally:
        srv.stop()
