"""Suffix speculation (`--speculative-algorithm suffix`): the store's matching, frequency choice,
memory bound and namespace isolation; on the default model, greedy output exactly as without
speculation and fewer forwards where requests repeat earlier requests' tool calls."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from radixlm.srt.core.request import Req
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.scheduler.suffix import SuffixStore, longest_match
from radixlm.srt.server_args import ServerArgs

TOOL_CALL = ("<|im_start|>system\nReply with one tool call as JSON.<|im_end|>\n<|im_start|>user\nWhat is the "
             "weather in Lisbon?<|im_end|>\n<|im_start|>assistant\n{\"name\": \"")
MAX_TOKENS = 512


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def test_the_most_frequent_continuation_of_the_longest_match_is_drafted():
    store = SuffixStore(1000, max_spec_factor=4.0)
    for output in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 2, 3, 4, 7]):
        store.add("ns", output)
    # "2 3" followed by 4 three times, then 5 twice and 7 once: 5 (probability 2/3).
    assert store.propose("ns", ids(8, 2, 3), 8) == [4, 5]
    # The longer match "9 2 3" occurred once: its own continuation, not the majority's.
    assert store.propose("ns", ids(9, 2, 3), 8) == [4, 7]
    # The request's own tokens are a second tree: each drafts, and the draft with more expected
    # accepted tokens wins: its own "2 3" -> 6 0 2 3 (seen once: 1 + 1 + 1 + 1) beats the
    # store's 4 5 (1 + 2/3).
    assert store.propose("ns", ids(2, 3, 6, 0, 2, 3), 8) == [6, 0, 2, 3]
    # An output is kept after its prompt's tail: a request whose prompt ends alike drafts it at once.
    store.add("ns", [7, 8, 9], prompt=[40, 41, 42])
    assert store.propose("ns", ids(0, 41, 42), 8) == [7, 8, 9]
    assert store.propose("ns", ids(6, 77), 8) == []  # never seen


def test_on_equal_scores_the_longer_match_drafts():
    store = SuffixStore(1000)
    store.add("ns", [1, 2, 3, 4, 5, 6, 7])
    # Own tokens: "3 4" -> 5 9 2; the store: "2 3 4" -> 5 6 7; both 3 tokens seen once each.
    assert store.propose("ns", ids(3, 4, 5, 9, 2, 3, 4), 3) == [5, 6, 7]
    store.add("ns", [0, 2, 3, 4, 8, 8, 8])  # now the store's 5 6 7 has probability 1/2 each step
    assert store.propose("ns", ids(3, 4, 5, 9, 2, 3, 4), 3) == [5, 9, 2]


def test_draft_length_follows_the_match_length_and_the_probability():
    store = SuffixStore(1000, max_spec_factor=1.0)  # 1 draft per matched token, while the probability >= 0.1
    store.add("ns", list(range(10, 30)))
    assert store.propose("ns", ids(5, 11), 8) == [12]
    assert store.propose("ns", ids(10, 11, 12), 8) == [13, 14, 15]
    assert store.propose("ns", ids(10, 11, 12), 2) == [13, 14]  # capped by the step's room
    for tail in range(11):  # eleven different tokens after 1, once each: 1/11 is below 0.1
        store.add("ns", [1, 100 + tail])
    assert store.propose("ns", ids(7, 1), 8) == []
    store.add("ns", [0, 1, 100, 101])
    store.add("ns", [0, 1, 100, 102])
    assert store.propose("ns", ids(7, 1), 8) == [100]  # 3 of 13 now
    # "0 1" twice, then 100 (1) and 101 or 102 (1/2, the newest): 1/2 >= 0.1; with a 0.6 bar, no.
    assert store.propose("ns", ids(0, 1), 8) == [100, 102]
    store.min_token_prob = 0.6
    assert store.propose("ns", ids(0, 1), 8) == [100]


def _longest_by_definition(buf, stop, tail, max_depth):
    best, found = 0, []
    for p in range(1, stop):
        k = 0
        while k < min(max_depth, len(tail)) and p - 1 - k >= 0 and buf[p - 1 - k] == tail[-1 - k]:
            k += 1
        if k > best:
            best, found = k, [p]
        elif k == best and k:
            found.append(p)
    return found, best


def test_longest_match_equals_its_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(1500):
        buf = np.array([rng.randrange(rng.choice([2, 3, 30])) for _ in range(rng.randrange(2, 80))], dtype=np.int32)
        tail = buf[-rng.randrange(1, len(buf) + 1):] if rng.random() < 0.7 else buf[:rng.randrange(1, len(buf))]
        stop, depth = rng.randrange(1, len(buf) + 1), rng.randrange(1, 30)
        pos, length = longest_match(buf, stop, tail, depth)
        want, want_length = _longest_by_definition(buf.tolist(), stop, tail.tolist(), depth)
        assert (pos.tolist(), length) == (want, want_length), (buf.tolist(), stop, tail.tolist(), depth)


def test_memory_stays_bounded_and_the_oldest_outputs_go_first():
    store = SuffixStore(100, max_spec_factor=1.0)
    for i in range(50):
        store.add(("salt", i % 3), [1000 + i] * 5 + [7, 8, 9])
        assert store.tokens <= 100
    assert store.tokens == 96  # 12 outputs of 8 tokens
    assert store.propose(("salt", 1), ids(5, 1046), 4) == [1046]  # output 46 is kept, in namespace 46 % 3
    assert store.propose(("salt", 2), ids(5, 1046), 4) == []
    assert store.propose(("salt", 1), ids(5, 1010), 4) == []  # evicted long ago
    store.add("big", list(range(101)))  # longer than the whole bound: not kept
    assert store.tokens == 96 and store.propose("big", ids(0, 1), 4) == []


def test_a_namespace_never_drafts_another_namespaces_text():
    rng = random.Random(1)
    store = SuffixStore(5000)
    secret = {ns: rng.sample(range(1000 * ns, 1000 * ns + 1000), 200) for ns in (1, 2)}
    shared = [5, 6, 7]  # both tenants' outputs start alike
    for ns, tokens in secret.items():
        for i in range(0, 200, 20):
            store.add(ns, shared + tokens[i:i + 20])
    for ns, tokens in secret.items():
        for i in range(0, 200, 7):
            context = np.array(shared + tokens[i:i + 3], dtype=np.int32)
            for draft in (store.propose(ns, context, 8), store.propose(3 - ns, context, 8)):
                assert all(t in secret[ns] or t in shared for t in draft)
            # the other tenant's text never continues this one's
            assert not set(store.propose(3 - ns, np.array(shared, dtype=np.int32), 8)) & set(secret[ns])


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="suffix", speculative_draft_model_path="/tmp"),
     "speculative_draft_model_path: suffix speculation drafts without a model"),
    (dict(speculative_suffix_max_tokens=0), "speculative_suffix_max_tokens: must be >= 1"),
    (dict(speculative_suffix_min_token_prob=1.5), "speculative_suffix_min_token_prob: must be between 0.0 and 1.0"),
    (dict(speculative_suffix_max_spec_factor=0), "speculative_suffix_max_spec_factor: must be"),
    (dict(speculative_algorithm="eagle"), "speculative_algorithm: .*ngram, suffix and draft"),
])
def test_bad_suffix_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)
    assert ServerArgs(speculative_algorithm="SUFFIX").speculative.speculative_algorithm == "suffix"


@pytest.fixture(scope="module")
def suffix_engine():
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=8192, speculative_algorithm="suffix", speculative_num_draft_tokens=8,
                 speculative_suffix_max_tokens=MAX_TOKENS)
    yield eng
    eng.shutdown()


def forwards(engine, prompt, params) -> tuple[dict, int]:
    """(the output, forwards it took): prefill, decode and verify steps."""
    before = engine.scheduler.steps_launched
    out = engine.generate(prompt, params)
    return out, engine.scheduler.steps_launched - before


def test_a_repeated_tool_call_takes_fewer_forwards_with_the_same_output(engine, suffix_engine):
    """The second request repeats the first's tool call: its output is drafted from the first's,
    greedy output is exactly the plain engine's, and it takes fewer forwards."""
    params = {"temperature": 0, "max_new_tokens": 24}
    plain, plain_forwards = forwards(engine, TOOL_CALL, params)
    suffix_engine.scheduler.decode.suffix.clear()
    first, _ = forwards(suffix_engine, TOOL_CALL, params)
    again, again_forwards = forwards(suffix_engine, TOOL_CALL, params)
    assert first["output_ids"] == again["output_ids"] == plain["output_ids"]
    assert again_forwards < plain_forwards // 2, (again_forwards, plain_forwards)
    assert again["meta_info"]["spec_verify_ct"] < len(again["output_ids"]) // 2
    sched = suffix_engine.scheduler
    assert sched.decode.suffix.tokens <= MAX_TOKENS and sched.kv_stats()["leaked"] == 0


def test_constrained_and_sampled_requests_speculate_exactly(engine, suffix_engine):
    """Drafts pass through the grammar (cut where it rejects them): constrained greedy output as
    the plain engine's. A sampled request verifies by rejection sampling and leaks nothing."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"]}
    prompt = TOOL_CALL[:-len("{\"name\": \"")]
    params = {"temperature": 0, "max_new_tokens": 16, "json_schema": json.dumps(schema)}
    want = engine.generate(prompt, params)["text"]
    outs = [suffix_engine.generate(prompt, params) for _ in range(2)]
    assert [o["text"] for o in outs] == [want, want]
    assert 0 < outs[1]["meta_info"]["spec_verify_ct"] < outs[1]["meta_info"]["completion_tokens"]
    sampled = suffix_engine.generate(TOOL_CALL, {"temperature": 0.8, "seed": 7, "max_new_tokens": 12})
    assert sampled["meta_info"]["completion_tokens"] == 12 or sampled["meta_info"]["finish_reason"]["type"] == "stop"
    stats = suffix_engine.scheduler.kv_stats()
    assert stats["leaked"] == 0 and stats["held_by_requests"] == 0


def test_abort_mid_speculation_leaks_nothing_and_keeps_the_store_bounded(suffix_engine):
    sched = suffix_engine.scheduler
    suffix_engine.generate(TOOL_CALL, {"temperature": 0, "max_new_tokens": 24})  # something to draft from
    req = Req(rid="suffix-abort", origin_input_ids=suffix_engine.tokenizer.encode(TOOL_CALL, add_special_tokens=False),
              sampling_params=SamplingParams(max_new_tokens=24, temperature=0.0))
    sched.add_request(req)
    while req.spec_verify_ct < 1 and sched.has_work:
        sched.step()
    assert req.spec_verify_ct >= 1 and sched.abort("suffix-abort") is req
    while sched.has_work:
        sched.step()
    stats = sched.kv_stats()
    assert stats["leaked"] == 0 and stats["held_by_requests"] == 0
    assert sched.decode.suffix.tokens <= MAX_TOKENS
