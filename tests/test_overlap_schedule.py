"""Overlap scheduling: a step is launched before the previous step's tokens are read back.

It is on by default on CUDA only (on CPU the forward itself runs on the host, so there is
nothing to overlap), but its bookkeeping is device-independent: these tests switch it on for a
CPU engine and check that what users get is exactly what the lockstep scheduler gives.
"""

from __future__ import annotations

import pytest

from radixlm.srt.core.request import Req
from radixlm.srt.sampling_params import SamplingParams


@pytest.fixture
def overlapped(engine):
    sched = engine.scheduler
    default = sched.overlap  # off on CPU
    sched.overlap = True
    yield engine
    sched.overlap = default
    assert not sched.has_work


def _run(engine, prompts, params):
    outs = engine.generate(prompts, params)
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]


PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):",
           "Once upon a time, in a small village,", "Q: What is 2 + 2?\nA:"]


def test_greedy_outputs_and_finish_reasons_are_unchanged(engine, overlapped):
    params = [{"temperature": 0, "max_new_tokens": n} for n in (1, 7, 24, 40, 12)]
    params[3]["stop"] = ["."]  # a stop string ends it mid-stream: one token computed and dropped
    # These end on EOS (after 4, 11 and 26 tokens) before their limit.
    eos_prompts = ["Translate 'cat' to French:", "The end.",
                   "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"]
    eos_params = {"temperature": 0, "max_new_tokens": 64}
    overlapped = _run(engine, PROMPTS, params), _run(engine, eos_prompts, eos_params)
    engine.scheduler.overlap = False
    lockstep = _run(engine, PROMPTS, params), _run(engine, eos_prompts, eos_params)
    engine.scheduler.overlap = True
    assert overlapped == lockstep
    assert lockstep[0][3][1]["matched"] == "."
    assert all(reason["type"] == "stop" and len(ids) < 64 for ids, reason in lockstep[1])
    assert engine.scheduler.kv_stats()["leaked"] == 0


def test_seeded_sampling_and_logprob_requests_are_unchanged(engine, overlapped):
    params = [{"temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "max_new_tokens": 16} for i in range(3)]
    params.append({"temperature": 0, "max_new_tokens": 10, "frequency_penalty": 0.5})  # runs in lockstep
    with_overlap = engine.generate(PROMPTS[:4], params, return_logprob=True, top_logprobs_num=2)
    engine.scheduler.overlap = False
    without = engine.generate(PROMPTS[:4], params, return_logprob=True, top_logprobs_num=2)
    engine.scheduler.overlap = True
    for a, b in zip(with_overlap, without):
        assert a["output_ids"] == b["output_ids"]
        got = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)


def test_a_step_is_launched_before_the_previous_tokens_are_read(engine, overlapped):
    sched = engine.scheduler
    ids = engine.tokenizer.encode("Count slowly: one, two,", add_special_tokens=False)
    req = Req(rid="lag", origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))
    sched.add_request(req)
    sched.step()  # prefill: its first token is sampled but not read back yet
    assert req.output_ids == [] and req.pending_tokens == 1 and req.kv_len == len(ids)
    stepped = sched.step()  # decode fed that token from the device, then the host read it
    assert stepped == [req] and len(req.output_ids) == 1 and req.pending_tokens == 1
    assert req.kv_len == len(ids) + 1
    while sched.has_work:
        sched.step()
    alone = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert req.output_ids == alone["output_ids"] and req.finish_reason.type == "length"
    assert sched.kv_stats()["leaked"] == 0


def test_abort_with_a_token_in_flight_frees_its_memory(engine, overlapped):
    sched = engine.scheduler
    ids = engine.tokenizer.encode("Abort me while a step runs", add_special_tokens=False)
    reqs = [Req(rid=f"abort-{i}", origin_input_ids=ids + [i + 5], sampling_params=SamplingParams(max_new_tokens=50))
            for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    for _ in range(4):
        sched.step()
    assert all(r.pending_tokens == 1 for r in reqs)
    assert sched.abort("abort-1") is reqs[1]
    produced = len(reqs[1].output_ids)
    sched.step()
    assert len(reqs[1].output_ids) == produced  # its in-flight token was dropped
    sched.abort_all("test over")
    assert not sched.has_work
    stats = sched.kv_stats()
    assert stats["leaked"] == 0 and stats["protected"] == 0


def test_retraction_under_memory_pressure_keeps_outputs(engine, caplog):
    """A KV pool too small for every request (6 x ~72 tokens in 300 slots): decode retracts
    requests (reading the in-flight tokens first, so a retracted request resumes with all of
    its output)."""
    import logging

    from radixlm.srt import Engine

    caplog.set_level(logging.INFO, logger="radixlm.srt.scheduler.decode")
    small = Engine(max_total_tokens=300, max_running_requests=8)
    try:
        prompts = [f"Write a long story about the number {i}." for i in range(6)]
        params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
        small.scheduler.overlap = True
        got = _run(small, prompts, params)
        assert any("retracted" in r.getMessage() for r in caplog.records)
        assert small.scheduler.kv_stats()["leaked"] == 0
        want = _run(engine, prompts, params)
        assert got == want
    finally:
        small.shutdown()


def test_decode_batch_takes_device_tokens_only_for_pending_ones():
    """A token already read back may have been replaced on the host since (jump-forward
    retokenizes it), so only requests whose token is still in flight read `last_tokens`."""
    import torch

    from radixlm.srt.executor.batch_builder import build_decode_batch
    from radixlm.srt.core.step import ExtendPlan

    in_flight = Req(rid="a", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams())
    in_flight.req_pool_idx, in_flight.kv_len, in_flight.pending_tokens = 0, 3, 1
    read_back = Req(rid="b", origin_input_ids=[4, 5], sampling_params=SamplingParams(), output_ids=[77])
    read_back.req_pool_idx, read_back.kv_len = 1, 2
    last_tokens = torch.tensor([41, 66])  # row 1's sampled 66 became 77 on the host
    parts = [ExtendPlan(in_flight, 3, 1, [10], 3, 1), ExtendPlan(read_back, 2, 1, [11], 2, 1)]
    batch = build_decode_batch(parts, torch.device("cpu"), last_tokens)
    assert batch.input_ids.tolist() == [41, 77] and batch.positions.tolist() == [3, 2]
