"""Bad input gets a ValueError naming the field, and the engine keeps working afterwards."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 2, 49152]}, "input_ids"),
        ({"input_ids": [1, -5]}, "input_ids"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"max_tokens": 5}}, "max_tokens"),
        ({"prompt": "hi", "sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
        ({"prompt": "hi", "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
        ({"prompt": "hi", "sampling_params": {"regex": "(?=lookahead)x"}}, "regex"),
        ({"prompt": "hi", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
        ({"prompt": "hi", "sampling_params": {"json_schema": '{"items":' * 5000 + "{}" + "}" * 5000}},
         "json_schema: nested too deeply"),
        ({"prompt": "hi", "sampling_params": {"json_schema": '{"items":' * 200 + "{}" + "}" * 200}},
         "deeper than 128"),
        ({"prompt": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "ebnf"),
        ({"prompt": "hi", "sampling_params": [{}, {}]}, "sampling_params"),
        ({"prompt": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_bad_input_names_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)


def test_prompt_longer_than_context(engine):
    too_long = [100] * engine.scheduler.context_len
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=too_long, sampling_params={"max_new_tokens": 1})


def test_engine_still_serves_after_errors(engine):
    with pytest.raises(ValueError):
        engine.generate("hi", {"bogus": 1})
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 3})
    assert out["text"].startswith(" Paris")
    assert engine.scheduler.kv_stats()["leaked"] == 0


def test_unknown_server_argument():
    from radixlm.srt import Engine

    with pytest.raises(ValueError, match="max_total_tokenz"):
        Engine(max_total_tokenz=10)
