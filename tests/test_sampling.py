"""Sampling behaviour users rely on: top_k=1 is greedy, seeds reproduce, penalties act as defined."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixlm.srt.executor.sampler import SeededStreams, apply_penalties, sample
from radixlm.srt.sampling_params import SamplingParams

PROMPT = "Write a short poem about the sea:\n"


@dataclass(eq=False)  # compared by identity, like the policy's records the streams are keyed by
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)

    @property
    def total_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


def _params(**kw):
    return SamplingParams.from_dict(kw)


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    top1 = engine.generate(PROMPT, {"temperature": 1.3, "top_k": 1, "max_new_tokens": 16, "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]


def test_fixed_seed_reproduces_and_seeds_differ(engine):
    params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    a = engine.generate(PROMPT, {**params, "seed": 7})
    b = engine.generate(PROMPT, {**params, "seed": 7})
    assert a["output_ids"] == b["output_ids"]
    others = [engine.generate(PROMPT, {**params, "seed": s})["output_ids"] for s in (1, 2, 3)]
    assert any(o != a["output_ids"] for o in others)


def test_seed_reproduces_inside_a_batch(engine):
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}
    solo = engine.generate(PROMPT, params)["output_ids"]
    batch = engine.generate([PROMPT, "Another prompt"], [params, {"temperature": 1.0, "max_new_tokens": 3}])
    assert batch[0]["output_ids"] == solo


def test_frequency_and_presence_penalties_subtract_as_defined():
    logits = torch.zeros(1, 10)
    req = FakeReq(_params(frequency_penalty=0.5, presence_penalty=0.25), output_ids=[3, 3, 7])
    apply_penalties(logits, [req], eos_ids=[])
    assert logits[0, 3].item() == pytest.approx(-(0.5 * 2 + 0.25))
    assert logits[0, 7].item() == pytest.approx(-(0.5 + 0.25))
    assert logits[0, 0].item() == 0.0


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    req = FakeReq(_params(repetition_penalty=2.0), origin_input_ids=[0], output_ids=[1])
    apply_penalties(logits, [req], eos_ids=[])
    assert logits[0].tolist() == [1.0, -4.0, 2.0, 1.0]


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, 6)
    req = FakeReq(_params(min_new_tokens=2, stop_token_ids=[4]), output_ids=[1])
    apply_penalties(logits, [req], eos_ids=[2])
    assert logits[0, 2] == float("-inf") and logits[0, 4] == float("-inf")


def test_top_p_and_min_p_keep_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for params, allowed in (({"top_p": 0.7}, {0, 1}), ({"min_p": 0.4}, {0, 1}), ({"top_k": 3}, {0, 1, 2})):
        req = FakeReq(_params(temperature=1.0, seed=0, **params))
        streams = SeededStreams("cpu")
        seen = {sample(logits.clone(), [req], streams).item() for _ in range(200)}
        assert seen <= allowed and len(seen) > 1


def test_per_position_streams_draw_by_seed_and_position_only():
    """--enable-deterministic-inference: a token depends on the request's seed and its position,
    not on how many draws came before it (a retried step, a retraction)."""
    logits = torch.zeros(1, 1000)
    req = FakeReq(_params(temperature=1.0, seed=7), origin_input_ids=[1, 2, 3])
    streams = SeededStreams("cpu", per_position=True)
    first = sample(logits.clone(), [req], streams).item()
    assert [sample(logits.clone(), [req], streams).item() for _ in range(3)] == [first] * 3
    req.output_ids.append(first)  # the next position draws afresh
    draws = {sample(logits.clone(), [req], streams).item() for _ in range(3)}
    assert len(draws) == 1
    other = FakeReq(_params(temperature=1.0, seed=8), origin_input_ids=[1, 2, 3])
    assert sample(logits.clone(), [other], SeededStreams("cpu", per_position=True)).item() != first
    plain = SeededStreams("cpu")  # without the flag the stream runs on
    assert len({sample(logits.clone(), [req], plain).item() for _ in range(5)}) > 1


def test_penalty_changes_generation(engine):
    base = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = engine.generate("List: apple, apple, apple,", base)["output_ids"]
    penalised = engine.generate("List: apple, apple, apple,", {**base, "frequency_penalty": 2.0})["output_ids"]
    assert len(set(penalised)) >= len(set(plain))
    assert penalised != plain
