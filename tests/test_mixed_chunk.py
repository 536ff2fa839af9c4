"""--enable-mixed-chunk: running requests decode inside prefill steps, with unchanged outputs."""

from __future__ import annotations

import pytest

from radixlm.srt.core.request import Req
from radixlm.srt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def mixed_engine():
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=8192, chunked_prefill_size=64, enable_mixed_chunk=True)
    yield eng
    eng.shutdown()


def test_streams_advance_during_a_long_prefill(mixed_engine, engine):
    sched = mixed_engine.scheduler
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    tok = mixed_engine.tokenizer
    streams = [Req(rid=f"s{i}", origin_input_ids=tok.encode(f"Story {i}: once upon a time"), sampling_params=params)
               for i in range(2)]
    for req in streams:
        sched.add_request(req)
    while any(len(r.output_ids) < 3 for r in streams):
        sched.step()
    long_prompt = tok.encode("The history of the city, told in detail. " * 40)  # ~400 tokens: 7 chunks of 64
    newcomer = Req(rid="long", origin_input_ids=long_prompt,
                   sampling_params=SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8}))
    sched.add_request(newcomer)
    before = [len(r.output_ids) for r in streams]
    while not newcomer.output_ids:  # the prefill, chunk by chunk
        sched.step()
    gained = [len(r.output_ids) - b for r, b in zip(streams, before)]
    assert min(gained) >= len(long_prompt) // 64  # a token per prefill chunk, not a stall
    while sched.has_work:
        sched.step()
    # Same greedy outputs as the plain scheduler (the shared engine fixture, no mixing).
    for req in streams + [newcomer]:
        alone = engine.generate(input_ids=req.origin_input_ids, sampling_params=req.sampling_params.to_dict())
        assert alone["output_ids"] == req.output_ids
    assert sched.kv_stats()["leaked"] == 0


def test_overlap_stays_on_between_prefills(mixed_engine, engine):
    """On CUDA overlap is on: with mixed chunks a step is committed before planning only when a
    prefill (with riders) comes next, so decode-only runs still overlap. Forced on here."""
    sched = mixed_engine.scheduler
    tok = mixed_engine.tokenizer
    prompts = [tok.encode(f"Story {i}: once upon a time") for i in range(3)]
    prompts.append(tok.encode("The history of the city, told in detail. " * 30))  # chunked, riders join
    params = [{"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}] * 3 + [{"temperature": 0, "max_new_tokens": 8}]
    before = sched.steps_overlapped
    sched.overlap = True
    try:
        outs = mixed_engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        sched.overlap = False
    assert sched.steps_overlapped - before > 10  # the decode steps after the prefills
    for ids, p, out in zip(prompts, params, outs):
        assert out["output_ids"] == engine.generate(input_ids=ids, sampling_params=p)["output_ids"]
    assert sched.kv_stats()["leaked"] == 0
