"""Tool calling on /v1/chat/completions and /v1/responses, driven by the official `openai`
client, LangChain and the OpenAI Agents SDK against a real server on the default model.

The 135M default model seldom calls a tool on its own, so the flows force it where they need a
call (tool_choice "required" or a named function); decoding is then constrained to the
functions' schemas, and every call's arguments must validate.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def assert_valid_calls(calls) -> None:
    assert calls, "expected at least one tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_returns_valid_calls(client, model):
    resp = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=TOOLS,
                                          tool_choice="required", temperature=0, max_tokens=100)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client, model):
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 12 plus 30?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=60)
    calls = resp.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    assert_valid_calls(calls)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble(client, model, tool_choice):
    stream = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=TOOLS,
                                            tool_choice=tool_choice, temperature=0, max_tokens=100, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] = delta.function.name or call["name"]
                call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_follow_up_turn_with_the_tool_result_answers(client, model):
    first = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = WEATHER_QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                                   {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=30)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_auto_without_a_tool_need_returns_content(client, model):
    resp = client.chat.completions.create(model=model, tools=TOOLS, temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": "Say hello to Ada."}])
    message = resp.choices[0].message
    assert message.content and not message.tool_calls and resp.choices[0].finish_reason in ("stop", "length")


# ---- the Responses API ------------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                    "parameters": WEATHER_PARAMS}]


def test_responses_text_and_continuation(client, model):
    first = client.responses.create(model=model, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=16, instructions="Answer in a few words.")
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert "Paris" in first.output_text
    follow = client.responses.create(model=model, previous_response_id=first.id, input="And of Italy?",
                                     temperature=0, max_output_tokens=16)
    assert follow.output_text and follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0, "the earlier turn is a cached prefix"
    assert client.responses.retrieve(follow.id).id == follow.id


def test_responses_function_call_round_trip(client, model):
    first = client.responses.create(model=model, input="What is the weather in Oslo?", tools=RESPONSES_TOOLS,
                                    tool_choice="required", temperature=0, max_output_tokens=80)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    answer = client.responses.create(model=model, previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Rain, 7 degrees"}],
                                     temperature=0, max_output_tokens=30, tool_choice="none")
    assert answer.output_text


def test_responses_stream_events(client, model):
    events = list(client.responses.create(model=model, input="What is the weather in Rome?", tools=RESPONSES_TOOLS,
                                          tool_choice="required", temperature=0, max_output_tokens=80, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    call = next(i for i in events[-1].response.output if i.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    text = list(client.responses.create(model=model, input="Say hi.", max_output_tokens=8, stream=True))
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert deltas and deltas == text[-1].response.output_text


def test_responses_bad_input_is_400_naming_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=model, input="hi", tools=RESPONSES_TOOLS,
                                tool_choice={"type": "function", "name": "nope"})
    assert exc.value.response.json()["error"]["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp_missing")


# ---- frameworks -------------------------------------------------------------------------------------

def test_langchain_bind_tools_loop(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=model,
                                      temperature=0, max_tokens=60, max_retries=0)
    messages = [HumanMessage("What is 2 plus 3? Use the add tool.")]
    ai = llm.bind_tools([add], tool_choice="add").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "add"
    call = ai.tool_calls[0]
    result = add.invoke(call["args"])
    messages += [ai, ToolMessage(str(result), tool_call_id=call["id"])]
    final = llm.bind_tools([add]).invoke(messages)
    assert isinstance(final.content, str)


def test_openai_agents_sdk_runs_a_function_tool(server, model):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no trace export to the network
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the tool.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert seen and result.final_output == f"Sunny in {seen[0]}"


# ---- reasoning ---------------------------------------------------------------------------------------

def test_reasoning_parser_with_a_template_that_opens_the_think_block(thinking_server):
    """The prompt ends inside <think>: what the model writes up to </think> is reasoning_content,
    the rest content, whole and streamed, as the parser splits the raw output."""
    from radixlm.srt.server.tool_calls.reasoning import split_reasoning

    srv = thinking_server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Is 17 a prime number? Think, then answer."}]
    resp = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
    message = resp.choices[0].message
    prompt = "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n<think>\n"
    with srv.client() as http:
        raw = http.post("/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 40}}).json()["text"]
    expected = split_reasoning("qwen3", raw, opened=True)
    assert raw and "<think>" not in (message.content or "")
    assert (message.model_extra["reasoning_content"], message.content) == (expected.reasoning, expected.content)
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40,
                                            stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning.strip() or None, content.strip() or None) == (expected.reasoning, expected.content)
