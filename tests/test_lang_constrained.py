"""Constrained gens in the language against the real server: gen_int, dtype gens, regex gens,
and a JSON extraction program, all sampled at temperature 1.0 so the constraint is what holds."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex
from pydantic import BaseModel, Field

import radixlm as sgl
from radixlm.backend import BackendError


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.base_url)


@sgl.function
def typed_answers(s):
    s += "How many legs does a spider have? " + sgl.gen_int("legs") + "\n"
    s += "Pi to two places: " + sgl.gen("pi", dtype=float) + "\n"
    s += "Is the sun a star? " + sgl.gen("star", dtype=bool) + "\n"
    s += "Name a fruit in quotes: " + sgl.gen_string("fruit", max_tokens=16) + "\n"
    s += "A date: " + sgl.gen("date", regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")


def test_typed_gens(backend):
    for state in typed_answers.run_batch([{}] * 3, backend=backend, temperature=1.0):
        int(state["legs"])
        float(state["pi"])
        assert state["star"] in ("True", "False")
        ended = state.get_meta_info("fruit")["finish_reason"]["type"] == "stop"
        assert regex.fullmatch(r'"[\w\d\s]*"' if ended else r'"[\w\d\s]*', state["fruit"])
        assert regex.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", state["date"])
        assert state.text().endswith(state["date"])


class Contact(BaseModel):
    name: str = Field(max_length=30)
    city: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@sgl.function
def extract_contact(s, text):
    s += sgl.user("Extract the person as JSON.\n\n" + text)
    s += sgl.assistant(sgl.gen("contact", json_schema=Contact, max_tokens=80))


def test_json_extraction_program(backend):
    texts = ["Maria Lopez, 34, moved to Madrid last year.", "Ken (age 52) lives in Osaka."]
    states = extract_contact.run_batch([{"text": t} for t in texts], backend=backend, temperature=1.0)
    for state in states:
        contact = Contact.model_validate_json(state["contact"])
        assert 0 <= contact.age <= 120


def test_json_schema_as_dict_and_text(backend):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    @sgl.function
    def prog(s):
        s += "Status: " + sgl.gen("a", json_schema=schema) + " / " + sgl.gen("b", json_schema=json.dumps(schema))

    state = prog.run(backend=backend, temperature=1.0)
    for name in ("a", "b"):
        jsonschema.validate(json.loads(state[name]), schema)


def test_bad_regex_is_a_clear_error(backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("y", regex="(unclosed")

    with pytest.raises(BackendError, match="regex.*parenthesis"):
        prog.run(backend=backend)
