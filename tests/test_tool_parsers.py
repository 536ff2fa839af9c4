"""Tool-call and reasoning parsers on model text, whole and streamed (no server)."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.server.tool_calls.parsers import StreamingToolParser, default_parser_name, parser_for
from radixlm.srt.server.tool_calls.reasoning import StreamingReasoning, prompt_opens_think, split_reasoning
from radixlm.srt.server.tool_calls.requests import (call_schema, check_tool_messages, check_tools,
                                                    constrained_calls, render_inputs)

TOOLS = ["get_weather", "add"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "add", "parameters": {"a": 3, "b": 4}}',
     None, [("get_weather", {"city": "Rome"}), ("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]', None, [("add", {"a": 5, "b": 6})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', None, [("get_weather", {"city": "Lima"})]),
    ("json", '```json\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n```', None,
     [("get_weather", {"city": "Kyiv"})]),
]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_each_family_format_parses(name, text, content, calls):
    parsed = parser_for(name, TOOLS).parse(text)
    assert parsed.content == content and _calls(parsed) == calls
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_text_gives_the_same_calls_and_content(name, text, content, calls):
    stream = StreamingToolParser(parser_for(name, TOOLS))
    streamed = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest = stream.finish()
    assert _calls(rest) == calls
    assert ((streamed + (rest.content or "")).strip() or None) == content


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "json"])
def test_plain_text_and_unknown_tools_stay_content(name):
    parser = parser_for(name, TOOLS)
    for text in ("Paris is the capital of France.", '{"name": "delete_everything", "arguments": {}}',
                 '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '{"city": "Paris"}'):
        parsed = parser.parse(text)
        assert parsed.calls == [] and parsed.content == text
    stream = StreamingToolParser(parser)
    text = "The answer is 4, no tools needed."
    assert "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)) == text


def test_default_parser_follows_the_template():
    assert default_parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_parser_name("<|python_tag|>{{ tools }}") == "llama3_json"
    assert default_parser_name("<tool_call>{{ tools }}</tool_call>") == "hermes"
    assert default_parser_name(None) == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        parser_for("pythonic", TOOLS)


def test_reasoning_splits_whole_and_streamed():
    text = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
    for parser in ("qwen3", "deepseek-r1"):
        split = split_reasoning(parser, text, opened=False)
        assert (split.reasoning, split.content) == ("The user wants 2+2.", "It is 4.")
    # The template opened the block: the output carries only the closing tag.
    split = split_reasoning("qwen3", "Count: 2 and 2.</think>It is 4.", opened=True)
    assert (split.reasoning, split.content) == ("Count: 2 and 2.", "It is 4.")
    assert split_reasoning("qwen3", "No thinking here.", opened=False).reasoning is None
    assert split_reasoning("deepseek-r1", "still thinking", opened=True).content is None
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n") and not prompt_opens_think("assistant\n")
    for parser, opened, out in (("qwen3", False, text), ("qwen3", True, "Count: 2 and 2.</think>It is 4."),
                                ("qwen3", False, "No thinking here.")):
        stream = StreamingReasoning(parser, opened)
        parts = [stream.feed(out[i:i + 2]) for i in range(0, len(out), 2)] + [stream.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        whole = split_reasoning(parser, out, opened)
        assert (reasoning.strip() or None, content.strip() or None) == (whole.reasoning, whole.content)


def test_tool_requests_are_checked_and_name_the_field():
    with pytest.raises(ValueError, match=r"^tool_choice: no tool named 'nope'"):
        check_tools([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: the JSON-schema keyword 'not'"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], "required", None)
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name"):
        check_tools([{"type": "function", "function": {"name": "has space"}}], "auto", None)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_call_id"):
        check_tool_messages([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}])
    check_tool_messages([{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]},
                         {"role": "tool", "tool_call_id": "x", "content": "1"}])
    assert check_tools([WEATHER], None, None).choice == "auto" and check_tools(None, None, None).choice == "none"


def test_constrained_schema_and_its_output():
    required = check_tools([WEATHER], "required", False)
    schema = call_schema(required)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "get_weather"}
    calls = constrained_calls(required, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert call_schema(named) == WEATHER["function"]["parameters"]
    assert [c.name for c in constrained_calls(named, '{"city": "Oslo"}')] == ["get_weather"]


def test_templates_without_tools_get_them_in_the_system_message():
    tools = check_tools([WEATHER], "auto", None)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, hf_tools = render_inputs(history, tools, chat_template="{{ messages }}")
    assert hf_tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    messages, hf_tools = render_inputs(history, tools, chat_template="{% if tools %}{{ tools }}{% endif %}")
    assert hf_tools[0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
