"""The OpenAI-compatible API, driven by the official `openai` client against a real server on
the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# ~250 tokens, so a repeat is served mostly from the radix cache.
LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40)) + " Summary:"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key or "unused", timeout=300,
                         max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import load_model

    return load_model(with_weights=False).tokenizer


def error_of(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


# ---- models -------------------------------------------------------------------------------------

def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert len(models) == 1
    card = models[0]
    assert card.object == "model" and card.owned_by == "radixlm"
    assert card.model_extra["max_model_len"] == 8192
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- chat ---------------------------------------------------------------------------------------

def test_chat_answers_paris(client, model):
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == model
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # ended at <|im_end|>, not at the context
    assert resp.usage.prompt_tokens > 10
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_template_renders_once_without_second_bos(client, model, tokenizer):
    rendered = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    plain = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=8)
    assert plain.usage.prompt_tokens == len(ids)
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    by_parts = client.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                              messages=[{"role": "user", "content": parts}])
    assert by_parts.choices[0].message.content == plain.choices[0].message.content
    assert by_parts.usage.prompt_tokens == len(ids)


def test_chat_stream_matches_non_stream(client, model):
    kwargs = dict(model=model, messages=FRANCE, temperature=0, max_tokens=20)
    resp = client.chat.completions.create(**kwargs)
    full, full_usage = resp.choices[0], resp.usage
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full_usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full_usage.prompt_tokens


def test_chat_n2_gives_two_indexed_choices(client, model):
    resp = client.chat.completions.create(model=model, messages=FRANCE, n=2, temperature=1.0, seed=7, max_tokens=8,
                                          logprobs=True)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content for c in resp.choices)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    assert resp.usage.prompt_tokens == 37  # the prompt counts once


def test_chat_n2_stream_interleaves_by_index(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=FRANCE, n=2, temperature=0, max_tokens=6,
                                                 stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1] and texts[0]  # greedy samples agree


def test_chat_logprobs_shape(client, model):
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
    plain = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_chat_stream_logprobs(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=6,
                                                 logprobs=True, stream=True))
    items = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(items) == 6 and "".join(t.token for t in items) == text


def test_chat_seed_reproducible(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Write a short poem."}], temperature=1.0,
                  max_tokens=12)
    first = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    again = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    assert first == again
    others = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {first}) > 1


def test_chat_max_completion_tokens_and_text_response_format(client, model):
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_completion_tokens=3,
                                          response_format={"type": "text"}, modalities=["text"])
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == "The capital of"


def test_chat_stop_string(client, model):
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, stop=[" Paris"])
    assert resp.choices[0].message.content == "The capital of France is"
    assert resp.choices[0].finish_reason == "stop"


# ---- completions --------------------------------------------------------------------------------

def test_completion_string_prompt(client, model):
    resp = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=2)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == model
    assert resp.choices[0].text == " Paris."
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 2


def test_completion_default_max_tokens_is_16(client, model):
    resp = client.completions.create(model=model, prompt="Once upon a time", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_completion_stop_trims_and_reports_stop(client, model):
    resp = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8,
                                     stop=".")
    assert resp.choices[0].text == " Paris" and resp.choices[0].finish_reason == "stop"


def test_completion_prompt_forms_agree(client, model, tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    by_text = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3)
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=3)
    assert by_ids.choices[0].text == by_text.choices[0].text == " Paris.\n"
    batch = client.completions.create(model=model, prompt=[ids, ids[:3]], temperature=0, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 3
    echoed = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=3, echo=True)
    assert echoed.choices[0].text == prompt + by_text.choices[0].text


def test_completion_list_of_prompts_with_n_orders_choices(client, model):
    prompts = ["The capital of France is", "The capital of Germany is"]
    resp = client.completions.create(model=model, prompt=prompts, n=2, temperature=0, max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    texts = [c.text for c in resp.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert "Paris" in texts[0] and "Berlin" in texts[2]
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == 10  # each prompt counts once, not once per sample


def test_completion_echo_and_logprobs(client, model):
    prompt = "The capital of France is"
    resp = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text.startswith(prompt) and choice.text == prompt + " Paris.\n"
    lp = choice.logprobs
    n_tokens = resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n_tokens)]
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    greedy_top = [max(top, key=top.get) for top in lp.top_logprobs[resp.usage.prompt_tokens:]]
    assert greedy_top == lp.tokens[resp.usage.prompt_tokens:]


def test_completion_logprobs_without_echo(client, model):
    resp = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=3,
                                     logprobs=1)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [" Paris", ".", "\n"] and lp.text_offset == [0, 6, 7]
    assert all(len(top) == 1 for top in lp.top_logprobs)
    plain = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_completion_stream_matches_non_stream(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", temperature=0, max_tokens=16)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_echo_logprobs(client, model):
    prompt = "The capital of France is"
    chunks = list(client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3, echo=True,
                                            logprobs=1, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert text == prompt + " Paris.\n" and "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_repeated_long_prompt_reports_cached_tokens(client, model):
    first = client.completions.create(model=model, prompt=LONG_PROMPT, temperature=0, max_tokens=1)
    second = client.completions.create(model=model, prompt=LONG_PROMPT, temperature=0, max_tokens=1)
    assert first.usage.prompt_tokens > 200
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text


def test_completion_seed_reproducible(client, model):
    kwargs = dict(model=model, prompt="My favourite animal is", temperature=1.0, max_tokens=10, seed=99)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_token_bytes_are_exact_for_split_characters(tokenizer):
    """A token holding part of a UTF-8 character reports its exact bytes ("bytes:\\x.." as text)."""
    from radixlm.srt.server.openai_protocol import TokenText

    names = TokenText(tokenizer)
    text = "Pizza 🍕 and café ☕"
    pieces = [names.get(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert b"".join(raw for _, raw in pieces) == text.encode()
    assert any(token.startswith("bytes:\\x") for token, _ in pieces)  # the emoji spans tokens
    assert names.get(tokenizer.eos_token_id)[0] == tokenizer.eos_token


# ---- logit bias ---------------------------------------------------------------------------------

def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_the_models(client, model, tokenizer):
    prompt = "The capital of France is"
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4, logprobs=1,
                                       logit_bias={str(banana): 100})
    assert forced.choices[0].text == tokenizer.decode([banana] * 4)
    # The logprobs are the model's own, not the biased distribution's (which gives banana ~1).
    assert forced.choices[0].logprobs.token_logprobs[0] < -5
    sampled = client.chat.completions.create(model=model, messages=FRANCE, temperature=1.0, seed=3, max_tokens=3,
                                             logit_bias={banana: 100})
    assert sampled.choices[0].message.content == tokenizer.decode([banana] * 3)

    plain = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3)
    assert plain.choices[0].text == " Paris.\n"
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    banned = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3,
                                       logit_bias={str(paris[0]): -100})
    assert banned.choices[0].text and not banned.choices[0].text.startswith(" Paris")


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0]"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    # Tool calling: an unknown forced tool, an unenforceable schema, a result answering no call.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),
    ({"max_tokens": 9000}, "max_tokens"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary is 49152 tokens
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    # Fields that would change the answer are refused, not ignored.
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
])
def test_chat_bad_input_is_400_naming_the_field(client, model, kwargs, param):
    body = {"model": model, "messages": FRANCE, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**body)
    err = error_of(exc)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 49152]}, "prompt"),
    ({"prompt": "word " * 9000}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"regex": "([0-9]+"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_completion_bad_input_is_400_naming_the_field(client, model, kwargs, param):
    body = {"model": model, "prompt": "hi", "max_tokens": 4}
    body.update(kwargs)
    extra = {k: body.pop(k) for k in ("regex", "ebnf", "stop_token_ids") if k in body}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**body, extra_body=extra or None)
    assert error_of(exc)["param"] == param


def test_malformed_json_is_400_and_server_keeps_serving(client, model, server):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(f"{server.base_url}{path}", content=b'{"model": "x", "messages": [', timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "JSON" in err["message"] and err["code"] == "invalid_request"
        r = httpx.post(f"{server.base_url}{path}", content=b"[1, 2]", timeout=30)
        assert r.status_code == 400
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=8)
    assert "Paris" in resp.choices[0].message.content


def wait_until_idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
        if info["num_active_requests_main"] == 0 and info.get("num_running_reqs", 0) == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"a request still runs after its client left: {info}")


LONG_GENERATION = {"messages": FRANCE, "max_tokens": 2000, "ignore_eos": True}  # minutes on CPU


def test_client_disconnect_mid_stream_aborts(client, model, server):
    body = {"model": model, **LONG_GENERATION, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = (line for line in r.iter_lines() if line.startswith("data:"))
        first = [json.loads(next(events)[5:]) for _ in range(6)]
        assert first[0]["choices"][0]["delta"]["role"] == "assistant"
    wait_until_idle(server)
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=8)
    assert "Paris" in resp.choices[0].message.content


def test_client_disconnect_before_non_streamed_answer_aborts(client, model, server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": model, **LONG_GENERATION}, timeout=3)
    wait_until_idle(server)
    resp = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=8)
    assert "Paris" in resp.choices[0].message.content
