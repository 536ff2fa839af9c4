"""Tools in the language: specs from dicts / pydantic models / functions, gen(tools=...) read
and rendered as /v1/chat/completions does, the `tool` role, and separate_reasoning. Unit tests
on a scripted backend with the default model's template; then the real server."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from typing import Any, Iterator, Literal, Optional

import jsonschema
import pytest
from pydantic import BaseModel

import radixlm as sgl
from radixlm.backend import Backend, Generation, Prompt
from radixlm.chat_template import ChatRenderer
from radixlm.tokenizer import DirTokenizer, load_client_tokenizer
from radixlm.tools import tool_spec


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.C, days: Optional[int] = None) -> str:
    """Get the weather forecast.

    Args:
        city: The city's name,
            in English.
        unit (Unit): The temperature unit.
    """
    return json.dumps({"city": city, "temperature": 21, "unit": Unit(unit).value, "days": days})


def search(query: str, tags: list[str], limit: int = 5, mode: Literal["fast", "exact"] = "fast",
           weights: dict[str, float] | None = None) -> list[str]:
    """Searches the notes.

    :param query: what to look for
    :param tags: only notes with these tags
    """
    return []


class Book(BaseModel):
    """Books a table."""

    restaurant: str
    people: int


def parameters(spec: dict[str, Any]) -> dict[str, Any]:
    return spec["function"]["parameters"]


# ---- specs ------------------------------------------------------------------------------------------

def test_specs_from_dicts_pydantic_models_and_functions():
    as_dict = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    assert tool_spec(as_dict) is as_dict

    weather = tool_spec(get_weather)["function"]
    assert weather["name"] == "get_weather" and weather["description"] == "Get the weather forecast."
    assert weather["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name, in English."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit."},
        "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}

    found = tool_spec(search)["function"]
    assert found["description"] == "Searches the notes."
    assert found["parameters"]["required"] == ["query", "tags"]
    assert found["parameters"]["properties"] == {
        "query": {"type": "string", "description": "what to look for"},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "only notes with these tags"},
        "limit": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "exact"]},
        "weights": {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]}}

    book = tool_spec(Book)["function"]
    assert book["name"] == "Book" and book["description"] == "Books a table."
    assert parameters(tool_spec(Book))["required"] == ["restaurant", "people"]
    assert "title" not in book["parameters"]


def test_a_signature_that_cannot_become_a_schema_names_the_parameter():
    def untyped(city, days: int): ...

    def star(city: str, *rest: str): ...

    def odd(city: str, when: complex): ...

    def keyed(scores: dict[int, float]): ...

    for fn, param in ((untyped, "city"), (star, "rest"), (odd, "when"), (keyed, "scores")):
        with pytest.raises(TypeError, match=f"tool {fn.__name__}: parameter '{param}'"):
            sgl.gen("call", tools=[fn])
    with pytest.raises(TypeError, match="a tool is an OpenAI-style dict"):
        sgl.gen("call", tools=["get_weather"])
    with pytest.raises(TypeError, match="needs tools"):
        sgl.gen("call", tool_choice="required")
    with pytest.raises(ValueError, match="tool_choice: no tool named 'nope'"):
        sgl.gen("call", tools=[get_weather], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="unknown parser"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")


# ---- gen(tools=...) on a scripted backend ---------------------------------------------------------------

@pytest.fixture(scope="module")
def template() -> DirTokenizer:
    from radixlm.srt.executor.model_loader import default_model_path, load_model

    tok = load_client_tokenizer(load_model(default_model_path(), with_weights=False).local_dir)
    assert isinstance(tok, DirTokenizer)
    return tok


class Scripted(Backend):
    """Answers each gen with the next scripted reply; the server's chat template and model info."""

    def __init__(self, tok: DirTokenizer, replies: list[str]):
        self.tok, self.replies, self.calls = tok, list(replies), []

    def get_model_info(self) -> dict[str, Any]:
        return {"chat_template": self.tok.chat_template, "special_tokens": self.tok.special_tokens,
                "model_path": "scripted"}

    def get_chat_template(self) -> ChatRenderer:
        return ChatRenderer(self.tok.apply_chat_template)

    def generate(self, prompt: Prompt, params: Any) -> Generation:
        self.calls.append((prompt.text, params))
        return Generation([self.replies.pop(0)], [{"id": len(self.calls)}])

    def generate_stream(self, prompt: Prompt, params: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        text = self.generate(prompt, params).texts[0]
        for i in range(0, len(text), 3):
            yield text[i:i + 3], {}

    def select(self, *args: Any) -> Any:
        raise NotImplementedError


@pytest.fixture(scope="module")
def hf_tokenizer(template: DirTokenizer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(template.path)


def route_prompt(hf_tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any]) -> str:
    """What /v1/chat/completions renders for these messages and tools (its own function)."""
    from radixlm.srt.server.chat import ChatOptions, prepare_turn

    return prepare_turn(hf_tokenizer, messages, [tool_spec(t) for t in tools], "auto", None, ChatOptions()).prompt


def run_call(call: dict[str, Any]) -> str:
    return get_weather(**call["arguments"]) if call["name"] == "get_weather" else "Booked."


def ask(s, tool_choice):
    s += sgl.system("You answer weather questions.")
    s += sgl.user("What is the weather in Paris?")
    s += sgl.assistant(sgl.gen("call", tools=[get_weather, Book], tool_choice=tool_choice, max_tokens=64))


weather_call = sgl.function(ask)


@sgl.function
def weather_agent(s, tool_choice):
    ask(s, tool_choice)
    for call in s["call"]:
        s += sgl.tool(run_call(call), call_id=call["id"])
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


CALL = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_call_round_trip_renders_as_the_chat_route(template, hf_tokenizer, stream):
    backend = Scripted(template, [CALL, "It is 21 degrees."])
    state = weather_agent.run("auto", backend=backend, stream=stream)
    assert state.error() is None
    [call] = state["call"]
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"} and call["id"].startswith("call_")
    messages = state.messages()
    assert messages[2] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert messages[3] == {"role": "tool", "content": get_weather("Paris"), "tool_call_id": call["id"]}
    # Every gen's prompt is the chat route's for the same messages and tools.
    (first, params), (second, _) = backend.calls
    assert first == route_prompt(hf_tokenizer, messages[:2], [get_weather, Book])
    assert second == route_prompt(hf_tokenizer, messages[:4], [get_weather, Book])
    assert params.json_schema is None
    assert "<tool_response>" in second and "You can call these functions" in second
    assert state.text() == second + "It is 21 degrees.<|im_end|>\n"
    # run_batch warms the constant prefix: the text up to the first gen, tools and all
    assert weather_agent.trace(backend=backend, tool_choice="auto").prefix == first


# A template with a tool section (Qwen-like): the tools reach it as its `tools` argument.
WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_a_tool_section_gets_the_tools_as_the_route_passes_them():
    from radixlm.srt.server.chat import ChatOptions, prepare_turn
    from radixlm.tokenizer import render_chat_template

    class Tok:  # the route's side: apply_chat_template(..., tools=..., tokenize=False)
        chat_template = WITH_TOOLS

        @staticmethod
        def apply_chat_template(messages, tools, add_generation_prompt, tokenize):
            return render_chat_template(WITH_TOOLS, {}, messages, add_generation_prompt, tools)

    class Own(Scripted):
        def get_model_info(self) -> dict[str, Any]:
            return {"chat_template": WITH_TOOLS}

        def get_chat_template(self) -> ChatRenderer:
            return ChatRenderer(lambda m, g: render_chat_template(WITH_TOOLS, {}, m, g))

    backend = Own(None, [CALL, "Warm."])
    state = weather_agent.run("auto", backend=backend)
    specs = [tool_spec(get_weather), tool_spec(Book)]
    prompts = [prepare_turn(Tok, state.messages()[:n], specs, "auto", None, ChatOptions()).prompt for n in (2, 4)]
    assert [prompt for prompt, _ in backend.calls] == prompts
    assert prompts[1].startswith("<|im_start|>system\nTools: get_weather, Book<|im_end|>")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompts[1]


def test_an_async_program_calls_tools_through_the_same_hooks(template):
    @sgl.function
    async def agent(s):
        ask(s, "auto")
        for call in await s.get("call"):
            s += sgl.tool(run_call(call), call_id=call["id"])
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    state = agent.run(backend=Scripted(template, [CALL, "Warm."]))
    assert [c["name"] for c in state["call"]] == ["get_weather"]
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "tool", "assistant"]


def test_required_and_named_calls_are_constrained_and_answers_without_calls(template):
    backend = Scripted(template, ['[{"name": "Book", "arguments": {"restaurant": "Chez Nous", "people": 2}}]',
                                  "Fine.", '{"city": "Oslo"}', "Cold.", "It is sunny.", "Anything else?"])
    state = weather_agent.run("required", backend=backend)
    assert [(c["name"], c["arguments"]) for c in state["call"]] == [("Book", {"restaurant": "Chez Nous", "people": 2})]
    schema = json.loads(backend.calls[0][1].wire_sampling()["json_schema"])
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert state.messages()[2]["content"] is None

    named = weather_agent.run({"type": "function", "function": {"name": "get_weather"}}, backend=backend)
    assert [(c["name"], c["arguments"]) for c in named["call"]] == [("get_weather", {"city": "Oslo"})]
    assert json.loads(backend.calls[2][1].wire_sampling()["json_schema"]) == parameters(tool_spec(get_weather))

    # auto, answered in text: no calls; the text is the turn's content
    answered = weather_agent.run("auto", backend=backend)
    assert answered["call"] == [] and answered.messages()[2] == {"role": "assistant", "content": "It is sunny."}


def test_tools_outside_an_assistant_turn_or_on_a_backend_without_the_template_are_errors(template):
    @sgl.function
    def bare(s):
        s += sgl.user("Hi") + sgl.gen("call", tools=[get_weather])

    with pytest.raises(ValueError, match="assistant turn"):
        bare.run(backend=Scripted(template, ["x"]))

    @sgl.function
    def text_before(s):
        s += "Notes.\n"
        ask(s, "auto")

    with pytest.raises(ValueError, match="chat turns only"):
        text_before.run(backend=Scripted(template, ["x"]))

    class NoInfo(Scripted):
        get_model_info = None

    with pytest.raises(ValueError, match="cannot render tools"):
        weather_agent.run("auto", backend=NoInfo(template, ["x"]))

    @sgl.function
    def unknown_call(s):
        s += sgl.user("Hi")
        s += sgl.tool("42", call_id="call_missing")

    with pytest.raises(ValueError, match="no earlier assistant turn made a call"):
        unknown_call.run(backend=Scripted(template, []))


def test_separate_reasoning_splits_the_think_block(template):
    @sgl.function
    def think(s):
        s += sgl.user("2+2?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("x", max_tokens=8), model_type="qwen3"))

    state = think.run(backend=Scripted(template, ["<think>\nTwo and two.\n</think>\n\nFour."]))
    assert state["x"] == "Four." and state["x_reasoning_content"] == "Two and two."
    assert sgl.separate_reasoning(sgl.gen("y"), model_type="deepseek-r1").reader.reasoning == "deepseek-r1"


def test_tools_load_no_torch_xgrammar_or_fastapi(template):
    code = f"""
import sys, radixlm as sgl
from radixlm.tools import ToolChat
def f(city: str) -> str:
    '''Weather.'''
reader = sgl.gen("c", tools=[f], tool_choice="required").reader
chat = ToolChat({template.chat_template!r}, {{}}, reader.tools, "t")
assert "You can call these functions" in chat.render([{{"role": "user", "content": "hi"}}], True)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "xgrammar", "fastapi")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


# ---- the real server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.base_url)


def test_required_and_named_arguments_validate_against_the_schema(backend):
    schemas = {"get_weather": parameters(tool_spec(get_weather)), "Book": parameters(tool_spec(Book))}
    choices = ["required", {"type": "function", "function": {"name": "Book"}}]
    required, named = weather_call.run_batch([{"tool_choice": c} for c in choices], backend=backend, temperature=0)
    assert required["call"] and [c["name"] for c in named["call"]] == ["Book"]
    for call in required["call"] + named["call"]:
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_a_round_trip_on_the_server_matches_the_chat_route(backend, server, hf_tokenizer):
    state = weather_agent.run({"type": "function", "function": {"name": "get_weather"}}, backend=backend,
                              temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    prompt = route_prompt(hf_tokenizer, messages[:4], [get_weather, Book])
    assert state.text().startswith(prompt + state["answer"])
    body = {"model": "default", "messages": messages[:4], "tools": [tool_spec(get_weather), tool_spec(Book)],
            "max_tokens": 1, "temperature": 0}
    with server.client() as client:
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == state.get_meta_info("answer")["prompt_tokens"]


def test_separate_reasoning_on_the_server(backend):
    @sgl.function
    def think(s):
        s += sgl.user("What is 2+2?")
        forced = sgl.gen("x", max_tokens=64, regex=r"<think>[a-z ]{1,12}</think>\n[A-Z][a-z]{1,8}")
        s += sgl.assistant(sgl.separate_reasoning(forced, model_type="qwen3"))

    state = think.run(backend=backend, temperature=0)
    raw = state.messages()[-1]["content"]  # the turn keeps the text as generated
    thought, answer = raw.removeprefix("<think>").split("</think>")
    assert state["x_reasoning_content"] == (thought.strip() or None) and state["x"] == answer.lstrip()
