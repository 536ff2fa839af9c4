"""Constrained decoding in the Engine: every output obeys its regex, schema or grammar, also when
sampled at temperature 1.0 (so the constraint, not the model, keeps it valid)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import regex

SAMPLED = {"temperature": 1.0, "max_new_tokens": 96}

REGEXES = {
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
}

SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]},
        },
        "required": ["name", "address"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "minItems": 2, "maxItems": 3}},
        "required": ["tags"],
    },
    "number_bounds": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"],
    },
    "optional_and_formats": {
        "type": "object",
        # (an email format has no length bound: at temperature 1.0 it may ramble to max_tokens)
        "properties": {"server": {"type": "string", "format": "ipv4"},
                       "born": {"type": "string", "format": "date"},
                       "nickname": {"type": "string", "maxLength": 12}},
        "required": ["server", "born"],
    },
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                   "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
    },
}


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_sampled_outputs_match_their_regex(engine, name):
    pattern = REGEXES[name]
    outs = engine.generate([f"Example {name}: "] * 4, {"regex": pattern, **SAMPLED})
    for out in outs:
        assert regex.fullmatch(pattern, out["text"]), (name, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_outputs_validate_against_their_schema(engine, name):
    schema = SCHEMAS[name]
    outs = engine.generate([f"A JSON value ({name}):", f"Here is {name} as JSON:", "JSON:"],
                           {"json_schema": schema, "temperature": 1.0, "max_new_tokens": 160})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
        assert "\n" not in out["text"] and "  " not in out["text"]  # whitespace is bounded


def test_ebnf_and_choices(engine):
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    outs = engine.generate(["Is water wet?"] * 3, {"ebnf": grammar, **SAMPLED})
    assert all(o["text"] in ("Answer: yes.", "Answer: no.") for o in outs)
    choices = [" Paris", " London", " Rome"]
    out = engine.generate("The capital of France is", {"choices": choices, "temperature": 0})
    assert out["text"] == " Paris"


def test_mixed_batch_keeps_unconstrained_requests_unchanged(engine):
    prompt = "The capital of France is"
    greedy = {"temperature": 0, "max_new_tokens": 12}
    alone = engine.generate(prompt, greedy)["text"]
    outs = engine.generate([prompt, "Pick a number:", prompt],
                           [greedy, {"regex": r"[0-9]{3}", **SAMPLED}, {"json_schema": SCHEMAS["enum"], **SAMPLED}])
    assert outs[0]["text"] == alone
    assert regex.fullmatch(r"[0-9]{3}", outs[1]["text"])
    jsonschema.validate(json.loads(outs[2]["text"]), SCHEMAS["enum"])


def test_many_requests_share_one_compile(engine):
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": -999, "maximum": 999}},
              "required": ["k"], "title": "shared"}
    outs = engine.generate([f"Item {i}:" for i in range(8)], {"json_schema": schema, **SAMPLED})
    assert all(isinstance(json.loads(o["text"])["k"], int) for o in outs)
    specs = [s for s in engine.scheduler.constraints.cache._futures if "shared" in s.value]
    assert len(specs) == 1


def test_grammar_ends_the_request_even_with_ignore_eos(engine):
    out = engine.generate("Digits:", {"regex": r"[0-9]{4}", "ignore_eos": True, "max_new_tokens": 50,
                                      "temperature": 1.0})
    assert regex.fullmatch(r"[0-9]{4}", out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_max_new_tokens_cuts_a_constrained_output(engine):
    out = engine.generate("Digits:", {"regex": r"[0-9]{40}", "max_new_tokens": 3, "temperature": 1.0})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 3
    assert regex.fullmatch(r"[0-9]+", out["text"])


def test_jump_forward_saves_steps_and_stays_valid(engine, monkeypatch):
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 12},
                                               "last_name": {"type": "string", "maxLength": 12},
                                               "is_student": {"type": "boolean"}},
              "required": ["first_name", "last_name", "is_student"]}
    runner = engine.scheduler.engine.runner
    forwards = []
    real_forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda batch, loads=None: forwards.append(1) or real_forward(batch, loads))
    params = {"json_schema": schema, "temperature": 0, "max_new_tokens": 80}
    texts, steps = {}, {}
    for jump in (False, True):
        monkeypatch.setattr(engine.scheduler.constraints, "jump_forward", jump)
        forwards.clear()
        out = engine.generate("Describe a student as JSON:", params)
        texts[jump], steps[jump] = out["text"], len(forwards)
        jsonschema.validate(json.loads(out["text"]), schema)
    assert steps[True] < steps[False], steps


def test_compile_timeout_fails_only_that_request(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.constraints.cache, "timeout_s", 0.0)
    outs = engine.generate(["Hello", "Hello"],
                           [{"regex": r"never-compiled-before-[0-9]{3}", "max_new_tokens": 8},
                            {"max_new_tokens": 4, "temperature": 0}])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "timed out" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["meta_info"]["completion_tokens"] == 4
    assert engine.scheduler.kv_stats()["leaked"] == 0


def test_retraction_keeps_the_grammar_state(engine):
    """A request retracted mid-output (its KV freed) resumes by prefilling its output so far;
    its matcher must still agree with that output, so the result stays valid."""
    from radixlm.srt.core.request import Req
    from radixlm.srt.sampling_params import SamplingParams

    sched = engine.scheduler
    schema = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
              "minItems": 12, "maxItems": 12}
    sp = SamplingParams.from_dict({"json_schema": schema, "temperature": 0, "max_new_tokens": 100})
    req = Req(rid="retract-me", origin_input_ids=engine.tokenizer.encode("Twelve numbers:"), sampling_params=sp)
    sched.add_request(req)
    while len(req.output_ids) < 10:
        sched.step()
    sched.decode.retract(req)
    assert req.kv_len == 0 and req in sched.prefill.waiting
    while not req.finished:
        sched.step()
    text = engine.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert sched.kv_stats()["leaked"] == 0


def test_a_backtracking_stop_regex_fails_alone_and_fast(engine):
    """"(a|aa)+b" over a run of a's backtracks exponentially: matching runs on the output's
    tail within a time budget, so the loop never freezes and only that request fails."""
    solo = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    start = time.perf_counter()
    outs = engine.generate(["hi", "The capital of France is"],
                           [{"regex": "a{36}", "stop_regex": ["(a|aa)+b"], "max_new_tokens": 40},
                            {"temperature": 0, "max_new_tokens": 8}])
    assert time.perf_counter() - start < 60  # it used to take minutes, stalling everyone
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "stop_regex" in reason["message"]
    assert outs[1]["text"] == solo["text"]
    assert engine.scheduler.kv_stats()["leaked"] == 0
