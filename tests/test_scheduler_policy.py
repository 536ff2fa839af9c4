"""The scheduling policy against a fake device engine: no model, no torch.

The fake engine checks what a real one relies on (every token it is asked to compute has its
own KV slot in the request's table row, distinct from all others) and answers with scripted
tokens, so admission, chunking, retraction, abort and the overlap hand-off are tested on the
policy alone, in milliseconds.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from radixlm.srt.core.request import Req
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.core.step import PendingStep, StepPlan, StepResult
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.server_args import ServerArgs

EOS = 2


def script(req: Req, index: int) -> int:
    """The token the fake model draws as `req`'s output token number `index`: a function of
    the request and position only, so any batching or overlap gives the same outputs."""
    return 10 + (sum(req.origin_input_ids) * 7 + index * 13) % 50


class FakeEngine:
    def __init__(self, loaded, args, req_to_token, num_kv_slots, *, eos_ids, grammar_backend):
        self.table = req_to_token
        self.num_kv_slots = num_kv_slots
        self.overlap = False
        self.plans: list[StepPlan] = []
        self.in_flight: list[PendingStep] = []  # launched, result not yet taken

    @staticmethod
    def kv_capacity(config, args) -> int:
        return args.cache.max_total_tokens

    def launch(self, plan: StepPlan) -> PendingStep:
        self.plans.append(plan)
        for part in plan.parts:
            req = part.req
            row = self.table[req.req_pool_idx, :part.start + part.extend_len].tolist()
            assert row[part.start:] == part.slots, "the table row holds the planned slots"
            assert 0 not in row, "every computed token has a slot (slot 0 is on the padding page)"
            assert len(set(row)) == len(row), "no two positions share a slot"
        result = self.result(plan)  # drawn now: the requests' state changes before it is read
        pending = PendingStep(plan, lambda: result)
        self.in_flight.append(pending)
        return pending

    def result(self, plan: StepPlan) -> StepResult:
        # Output index of each sampling request's new token: what it has, plus what is in flight.
        indexes = [len(r.output_ids) + r.pending_tokens for r in plan.sampling_reqs]
        return StepResult([script(r, i) for r, i in zip(plan.sampling_reqs, indexes)])


class CopyingEngine(FakeEngine):
    """A fake greedy model whose output per request is `OUTPUTS[rid]`, verifying drafts as the
    real engine does: the drafts equal to that output are kept, then its next token."""

    OUTPUTS: dict[str, list[int]] = {}

    def result(self, plan: StepPlan) -> StepResult:
        tokens, spec_tokens = [], {}
        for i, part in enumerate(p for p in plan.parts if p.samples):
            req = part.req
            want = self.OUTPUTS[req.rid][len(req.output_ids) + req.pending_tokens:]
            kept = 0
            while kept < len(part.drafts) and part.drafts[kept] == want[kept]:
                kept += 1
            tokens.append(want[0])
            if part.drafts:
                spec_tokens[i] = want[:kept + 1]
        return StepResult(tokens, spec_tokens=spec_tokens)


def make_scheduler(engine_factory=FakeEngine, **overrides) -> Scheduler:
    args = dict(max_total_tokens=256, max_running_requests=8, chunked_prefill_size=64, max_prefill_tokens=64,
                context_length=512, device="cpu")
    args.update(overrides)
    config = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=64, context_len=512)
    tokenizer = SimpleNamespace(eos_token_id=EOS, decode=lambda ids, **_: "".join(chr(65 + i % 26) for i in ids))
    loaded = SimpleNamespace(config=config, tokenizer=tokenizer)
    return Scheduler(loaded, ServerArgs(**args), engine_factory=engine_factory)


def make_req(rid: str, prompt_len: int, max_new_tokens: int = 8, first_token: int = 20, **params) -> Req:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **params)
    return Req(rid=rid, origin_input_ids=[first_token + i % 30 for i in range(prompt_len)], sampling_params=sp)


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work or sched.pending is not None:
        sched.step()
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    return steps


def expected_output(req: Req) -> list[int]:
    return [script(req, i) for i in range(req.sampling_params.max_new_tokens)]


def assert_no_leak(sched: Scheduler) -> None:
    stats = sched.kv_stats()
    assert stats["leaked"] == 0 and stats["protected"] == 0 and stats["held_by_requests"] == 0, stats
    assert sched.req_table.available_size == sched.args.scheduler.max_running_requests


def test_the_policy_imports_no_torch():
    code = ("import sys; import radixlm.srt.scheduler.scheduler, radixlm.srt.scheduler.loop; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_batches_waiting_requests_and_outputs_follow_the_script():
    sched = make_scheduler()
    reqs = [make_req(f"r{i}", 10, first_token=20 + i) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    run_to_end(sched)
    first = sched.engine.plans[0]
    assert not first.decode and first.reqs == reqs, "all three prompts fit one extend step"
    assert all(p.decode and len(p.parts) == 3 for p in sched.engine.plans[1:])
    for req in reqs:
        assert req.output_ids == expected_output(req) and req.finish_reason.type == "length"
    assert_no_leak(sched)


def test_max_running_requests_caps_the_batch():
    sched = make_scheduler(max_running_requests=2)
    reqs = [make_req(f"r{i}", 5, first_token=20 + i) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    run_to_end(sched)
    assert max(len(p.parts) for p in sched.engine.plans) <= 2
    assert all(r.output_ids == expected_output(r) for r in reqs)
    assert_no_leak(sched)


def test_unset_batch_settings_take_the_devices_defaults():
    sched = make_scheduler(max_running_requests=None, chunked_prefill_size=None)
    assert (sched.args.scheduler.max_running_requests, sched.args.scheduler.chunked_prefill_size) == (64, 2048)
    assert sched.req_table.available_size == 64
    gpu = ServerArgs(device="cuda:1", chunked_prefill_size=4096).with_device_defaults()
    assert (gpu.scheduler.max_running_requests, gpu.scheduler.chunked_prefill_size) == (512, 4096)  # what was given stays


def test_a_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(chunked_prefill_size=16, max_prefill_tokens=16)
    req = make_req("long", 50, max_new_tokens=3)
    sched.add_request(req)
    run_to_end(sched)
    chunks = [p.parts[0] for p in sched.engine.plans if not p.decode]
    assert [(c.start, c.extend_len) for c in chunks] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert [c.samples for c in chunks] == [False, False, False, True], "only the last chunk draws a token"
    assert req.output_ids == expected_output(req)
    assert_no_leak(sched)


def test_a_shared_prefix_is_computed_once():
    sched = make_scheduler()
    prefix = list(range(20, 60))
    first = Req(rid="a", origin_input_ids=prefix + [5], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    sched.add_request(first)
    run_to_end(sched)
    second = Req(rid="b", origin_input_ids=prefix + [6], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    sched.add_request(second)
    run_to_end(sched)
    extend = [p for p in sched.engine.plans if not p.decode][-1].parts[0]
    assert second.cached_tokens == len(prefix) and (extend.start, extend.extend_len) == (len(prefix), 1)
    assert_no_leak(sched)


def test_retraction_frees_kv_and_the_output_is_unchanged():
    # 4 requests of 20 prompt tokens that each decode 40: 240 tokens of KV wanted at the end,
    # in a pool of 160. Admission is optimistic, so decoding must retract and resume.
    sched = make_scheduler(max_total_tokens=160)
    reqs = [make_req(f"r{i}", 20, max_new_tokens=40, first_token=20 + i) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    retracted = []
    real_retract = sched.decode.retract
    sched.decode.retract = lambda req: retracted.append(req.rid) or real_retract(req)
    run_to_end(sched)
    assert retracted, "the pool was too small for every request to decode to the end"
    resumed = [p for plan in sched.engine.plans if not plan.decode for p in plan.parts
               if p.req.rid in retracted and p.start + p.extend_len > len(p.req.origin_input_ids)]
    assert resumed, "a retracted request came back by prefilling its prompt and output so far"
    for req in reqs:
        assert req.output_ids == expected_output(req), req.rid
    assert_no_leak(sched)


def test_abort_frees_kv_wherever_the_request_is():
    sched = make_scheduler(chunked_prefill_size=8, max_prefill_tokens=8)
    waiting = make_req("waiting", 5, first_token=40)
    chunked = make_req("chunked", 30, first_token=20)
    running = make_req("running", 4, max_new_tokens=50, first_token=60)
    sched.add_request(running)
    sched.step()  # running: prefilled, decoding
    sched.add_request(chunked)
    sched.add_request(waiting)
    sched.step()  # chunked: first chunk; waiting: no budget left
    assert sched.prefill.chunked is chunked and waiting in sched.prefill.waiting
    for req in (waiting, chunked, running):
        assert sched.abort(req.rid) is req and req.finish_reason.type == "abort"
    assert sched.abort("unknown") is None
    run_to_end(sched)
    assert_no_leak(sched)


def test_overlap_hand_off_gives_the_lockstep_outputs():
    outputs = {}
    for overlap in (False, True):
        sched = make_scheduler()
        sched.overlap = overlap
        reqs = [make_req(f"r{i}", 6 + i, max_new_tokens=5 + 3 * i, first_token=20 + i) for i in range(4)]
        reqs.append(make_req("stop", 6, max_new_tokens=30, first_token=30, stop_token_ids=[script(reqs[0], 3)]))
        for req in reqs:
            sched.add_request(req)
        max_in_flight = 0
        while sched.has_work or sched.pending is not None:
            sched.step()
            max_in_flight = max(max_in_flight, max(r.pending_tokens for r in reqs))
        outputs[overlap] = [(r.output_ids, r.finish_reason) for r in reqs]
        assert max_in_flight == (1 if overlap else 0), "overlap leaves one step in flight between turns"
        assert_no_leak(sched)
    assert outputs[True] == outputs[False]


def test_overlap_commits_a_step_before_the_next_one_that_needs_its_tokens():
    """A request with penalties needs its newest token on the host: its steps run in lockstep."""
    sched = make_scheduler()
    sched.overlap = True
    req = make_req("penalised", 6, max_new_tokens=6, frequency_penalty=0.5)
    sched.add_request(req)
    while sched.has_work or sched.pending is not None:
        sched.step()
        assert sched.pending is None and req.pending_tokens == 0
    assert req.output_ids == expected_output(req)
    assert_no_leak(sched)


def test_abort_with_a_step_in_flight_drops_its_token_and_frees_kv():
    sched = make_scheduler()
    sched.overlap = True
    req = make_req("r", 6, max_new_tokens=20)
    sched.add_request(req)
    sched.step()
    sched.step()
    assert sched.pending is not None and req.pending_tokens == 1
    produced = list(req.output_ids)
    assert sched.abort("r") is req
    run_to_end(sched)
    assert req.output_ids == produced and req.pending_tokens == 0
    assert_no_leak(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_many_requests_with_pages_leak_nothing(page_size):
    sched = make_scheduler(page_size=page_size, max_total_tokens=256)
    reqs = [make_req(f"r{i}", 3 + i % 7, max_new_tokens=1 + i % 9, first_token=20 + i % 3) for i in range(24)]
    for req in reqs:
        sched.add_request(req)
    run_to_end(sched)
    assert all(r.output_ids == expected_output(r) for r in reqs)
    assert_no_leak(sched)


def test_a_huge_max_new_tokens_does_not_starve_the_queue():
    """Admission keeps room for running requests' decoding, but never more than the context
    length allows: a request asking for 10^9 tokens must not hold everyone else back."""
    sched = make_scheduler(max_total_tokens=2048, context_length=1024)
    greedy = make_req("greedy", 8, max_new_tokens=10**9)
    sched.add_request(greedy)
    sched.step()
    small = make_req("small", 8, max_new_tokens=4, first_token=40)
    sched.add_request(small)
    for _ in range(20):
        sched.step()
    assert small.finished and small.output_ids == expected_output(small)
    assert not greedy.finished
    sched.abort("greedy")
    run_to_end(sched)
    assert_no_leak(sched)


def test_ngram_drafting_pauses_where_nothing_copies_and_resumes_where_it_does():
    """An output that first chats (its n-gram drafts are wrong, or there are none) and then
    copies the prompt: drafting stops after a few verify steps that accept nothing, comes back
    and keeps going once the drafts are accepted. Steps without drafts overlap; verify steps
    run in lockstep. The output is the model's either way."""
    sched = make_scheduler(CopyingEngine, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    sched.overlap = True
    prompt = list(range(30, 54))
    chat = [t for i in range(15) for t in (30, 3 + i)]  # after each 30, n-gram drafts what followed the last 30
    copy = prompt * 2
    req = Req(rid="chat-then-copy", origin_input_ids=prompt,
              sampling_params=SamplingParams(max_new_tokens=len(chat) + len(copy), temperature=0.0))
    CopyingEngine.OUTPUTS[req.rid] = chat + copy
    sched.add_request(req)
    verify_ct_in_chat = None
    while sched.has_work or sched.pending is not None:
        sched.step()
        plan = sched.engine.plans[-1]
        drafts = any(p.drafts for p in plan.parts)
        if plan.decode or drafts:  # a plain decode step stays in flight, a verify step does not
            assert (sched.pending is not None) == (not drafts)
        if verify_ct_in_chat is None and len(req.output_ids) >= len(chat):
            verify_ct_in_chat = req.spec_verify_ct
    assert req.output_ids == chat + copy
    assert verify_ct_in_chat <= 4, "drafting went on where it did not pay"
    copied_verify_ct = req.spec_verify_ct - verify_ct_in_chat
    assert 0 < copied_verify_ct <= len(copy) // 4, "drafting did not resume where the output copies"
    info = sched.server_info()["overlap"]
    assert info["enabled"] and info["overlapped_steps"] >= len(chat) - 10
    assert_no_leak(sched)
