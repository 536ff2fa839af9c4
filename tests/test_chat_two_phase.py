"""A constrained answer after a think block (--reasoning-parser with a required tool call):
each choice reasons first, stopped at </think>, then answers constrained to the call; whole
and streamed, on /v1/chat/completions and /v1/responses, with n choices. Against a real server whose template opens the think block; a few examples in
the conversation teach the small default model to close it."""

from __future__ import annotations

import json

import openai
import pytest

SHOTS = [m for q in ("What is 2+2?", "What is the capital of Italy?", "Name a color.")
         for m in ({"role": "user", "content": q}, {"role": "assistant", "content": "<think>\nEasy.</think>\n\nDone."})]
MESSAGES = SHOTS + [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60)


@pytest.fixture(scope="module")
def client(thinking_server):
    """The shared server whose template opens the think block (conftest.THINKING_TEMPLATE)."""
    return openai.OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _call(tool_call) -> tuple[str, dict]:
    return tool_call.function.name, json.loads(tool_call.function.arguments)


def test_reasoning_then_a_constrained_call(client):
    resp = client.chat.completions.create(**ASK)
    choice = resp.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Easy."
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    name, args = _call(choice.message.tool_calls[0])
    assert name == "get_weather" and isinstance(args["city"], str)


def test_streamed_phases_reassemble_to_the_whole_answer(client):
    whole = client.chat.completions.create(**ASK)
    reasoning, calls, finishes, usage = "", {}, [], None
    for chunk in client.chat.completions.create(**ASK, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for call in c.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert reasoning.strip() == whole.choices[0].message.model_extra["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [_call(c) for c in whole.choices[0].message.tool_calls]
    assert finishes == ["tool_calls"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_n_choices_each_reason_and_call(client):
    one = client.chat.completions.create(**ASK)
    resp = client.chat.completions.create(**ASK, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:  # greedy: both as the single choice
        assert c.message.model_extra["reasoning_content"] == "Easy." and c.finish_reason == "tool_calls"
        assert _call(c.message.tool_calls[0]) == _call(one.choices[0].message.tool_calls[0])
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert resp.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_responses_reason_then_call_whole_and_streamed(client):
    kwargs = dict(model="default", input=MESSAGES, temperature=0, max_output_tokens=60, tool_choice="required",
                  tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}])
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "Easy." and whole.output[1].name == "get_weather"
    events = list(client.responses.create(**kwargs, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert reasoning.strip() == "Easy."
    assert json.loads(arguments) == json.loads(whole.output[1].arguments)
    done = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in done.output] == ["reasoning", "function_call"]
    assert done.usage.output_tokens == whole.usage.output_tokens
