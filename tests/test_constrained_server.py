"""Constrained decoding through the real server: native /generate (plain and streamed), the
OpenAI API's response_format and extra fields, concurrency, aborts and bad specs."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import regex

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "languages"],
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _generate(server, body, timeout=300):
    with server.client(timeout=timeout) as c:
        return c.post("/generate", json=body)


def test_native_json_schema(server):
    resp = _generate(server, {"text": ["Person 1 as JSON:", "Person 2 as JSON:"],
                              "sampling_params": {"json_schema": json.dumps(PERSON), "temperature": 1.0,
                                                  "max_new_tokens": 120}})
    assert resp.status_code == 200
    for out in resp.json():
        jsonschema.validate(json.loads(out["text"]), PERSON)


def test_native_stream_of_a_constrained_output(server):
    pattern = r"\d{3}-\d{4}"
    body = {"text": "Call me at ", "stream": True,
            "sampling_params": {"regex": pattern, "temperature": 1.0, "max_new_tokens": 30}}
    texts = []
    with server.client() as c, c.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["text"])
    assert len(texts) >= 2 and regex.fullmatch(pattern, texts[-1])
    assert all(texts[-1].startswith(t) for t in texts)  # chunks only ever extend the text


def test_concurrent_requests_share_a_grammar_and_mix_with_plain_ones(server):
    schema = {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"}},
              "required": ["id", "ok"]}

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
            constrained = [c.post("/generate", json={"text": f"Record {i}:", "sampling_params": {
                "json_schema": schema, "temperature": 1.0, "max_new_tokens": 40}}) for i in range(6)]
            plain = [c.post("/generate", json={"text": f"Story {i}:", "sampling_params": {
                "temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}}) for i in range(3)]
            return await asyncio.gather(*constrained, *plain)

    results = [r.json() for r in asyncio.run(run())]
    for out in results[:6]:
        jsonschema.validate(json.loads(out["text"]), schema)
    assert all(out["meta_info"]["completion_tokens"] == 16 for out in results[6:])


async def _until_running(client) -> None:
    """Waits until the server decodes a request (instead of sleeping a fixed time)."""
    while (await client.get("/get_server_info")).json()["num_running_reqs"] < 1:
        await asyncio.sleep(0.05)


def test_abort_mid_grammar_frees_its_memory(server):
    body = {"text": "Numbers:", "rid": "abort-grammar",
            "sampling_params": {"regex": r"(\d{1,3}, ){2000}", "temperature": 1.0, "max_new_tokens": 3000}}

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
            gen = asyncio.create_task(c.post("/generate", json=body))
            await asyncio.wait_for(_until_running(c), 120)  # its grammar compiled, its output under way
            assert (await c.post("/abort_request", json={"rid": "abort-grammar"})).status_code == 200
            return (await gen).json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert regex.fullmatch(r"(\d{1,3}, )*\d{0,3},? ?", out["text"])
    with server.client() as c:
        kv = c.get("/get_server_info").json()["kv"]
    assert kv["leaked"] == 0


@pytest.mark.parametrize("sampling, field", [
    ({"regex": "[0-9]+("}, "regex"),
    ({"ebnf": "root ::= missing"}, "ebnf"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "string", "format": "color"}}}},
     "json_schema.properties.a"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
])
def test_bad_spec_is_400_with_the_compilers_words(server, sampling, field):
    resp = _generate(server, {"text": "hi", "sampling_params": sampling})
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]
    assert _generate(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_openai_response_format_json_schema(client, server):
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}], temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    assert resp.choices[0].finish_reason == "stop"


def test_openai_json_object_and_regex_extra(client):
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me JSON."}],
                                          temperature=1.0, max_tokens=200, response_format={"type": "json_object"})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:
        assert resp.choices[0].message.content.startswith("{")
    comp = client.completions.create(model=model, prompt="Today's date:", max_tokens=20, temperature=1.0,
                                     extra_body={"regex": r" \d{4}-\d{2}-\d{2}"})
    assert regex.fullmatch(r" \d{4}-\d{2}-\d{2}", comp.choices[0].text)


def test_openai_bad_schema_names_response_format(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "obj"}}})
    assert exc.value.body["param"] == "response_format.json_schema.schema"
