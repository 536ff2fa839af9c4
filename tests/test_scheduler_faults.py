"""A forward that fails (a fault we can only inject) ends its requests and leaks no KV."""

from __future__ import annotations

import pytest

from radixlm.srt.core.request import Req
from radixlm.srt.sampling_params import SamplingParams


@pytest.mark.parametrize("fail_on_call", [1, 3])  # 1: the extend forward; 3: a decode forward
def test_failed_forward_aborts_in_flight_requests_without_leaks(engine, monkeypatch, fail_on_call):
    sched = engine.scheduler
    real_forward = sched.engine.runner.forward
    calls = {"n": 0}

    def flaky_forward(batch, loads=None):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise RuntimeError("injected fault")
        return real_forward(batch, loads)

    monkeypatch.setattr(sched.engine.runner, "forward", flaky_forward)
    ids = engine.tokenizer.encode("A request that will meet a fault", add_special_tokens=False)
    reqs = [Req(rid=f"fault-{i}", origin_input_ids=ids + [i + 10], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0.0)) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    with pytest.raises(RuntimeError, match="injected"):
        while sched.has_work:
            sched.step()
    aborted = sched.abort_all("internal error: injected fault")
    assert {r.rid for r in aborted} == {r.rid for r in reqs}
    assert all(r.finish_reason.type == "abort" for r in reqs)
    assert not sched.has_work
    stats = sched.kv_stats()
    assert stats["leaked"] == 0 and stats["protected"] == 0
    monkeypatch.undo()
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 3})
    assert out["text"].startswith(" Paris")


def test_abort_of_the_last_running_request_leaves_the_scheduler_idle(engine):
    sched = engine.scheduler
    ids = engine.tokenizer.encode("Abort me after one token", add_special_tokens=False)
    req = Req(rid="abort-last", origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=50))
    sched.add_request(req)
    sched.step()  # prefill: the request is now running
    assert sched.abort("abort-last") is req and req.finish_reason.type == "abort"
    assert not sched.has_work and sched.server_info()["num_running_reqs"] == 0
    assert sched.kv_stats()["leaked"] == 0
