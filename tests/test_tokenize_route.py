"""/tokenize: the server's tokenizer over HTTP (SGLang's route and names), as /generate sees it."""

from __future__ import annotations

import pytest

TEXTS = ["The capital of France is", "<|im_start|>user\nHi<|im_end|>\n", ""]


def test_tokenize_gives_the_ids_generate_sees(server):
    with server.client() as client:
        one = client.post("/tokenize", json={"prompt": TEXTS[0], "add_special_tokens": False}).json()
        many = client.post("/v1/tokenize", json={"prompt": TEXTS, "add_special_tokens": False, "model": "x"}).json()
        generated = client.post("/generate", json={"text": TEXTS[0], "sampling_params": {"max_new_tokens": 0}})
    assert one["count"] == len(one["tokens"]) == generated.json()["meta_info"]["prompt_tokens"]
    assert many["tokens"][0] == one["tokens"] and many["count"] == [len(t) for t in many["tokens"]]
    assert many["tokens"][2] == [] and one["max_model_len"] == 8192
    # Special tokens are parsed as themselves (one id each), as /generate does.
    assert many["tokens"][1][0] == 1 and many["tokens"][1][-2:] == [2, 198]


@pytest.mark.parametrize("body, field", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ({"prompt": "a", "text": "b"}, "text"),
])
def test_bad_tokenize_input_is_400_naming_the_field(server, body, field):
    with server.client() as client:
        response = client.post("/tokenize", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
