"""Constrained decoding on CUDA: the bitmask applies to GPU logits (also inside CUDA-graph decode
batches), so even a random model's sampled outputs obey their schema and regex."""

from __future__ import annotations

import json

import pytest
import regex

from gpu_helpers import llama3_tokenizer_path, small_llama_config

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "tag": {"enum": ["alpha", "beta", "gamma"]},
                         "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"]}


# jsonschema is not on the GPU machine (no package registry there): SCHEMA checked by hand.
def _matches_schema(obj) -> bool:
    return (isinstance(obj, dict) and {"id", "tag", "ok"} <= set(obj) and type(obj["id"]) is int
            and 0 <= obj["id"] <= 9999 and obj["tag"] in ("alpha", "beta", "gamma") and type(obj["ok"]) is bool)


PATTERN = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def test_constrained_outputs_on_gpu(tmp_path):
    from radixlm.srt import Engine

    engine = Engine(small_llama_config(tmp_path), load_format="dummy", tokenizer_path=llama3_tokenizer_path(),
                    max_total_tokens=16384, max_running_requests=16)
    try:
        assert engine.scheduler.engine.device.type == "cuda"
        prompts = [[1000 + i, 2000 + i, 3000 + i] for i in range(12)]
        params = [{"json_schema": SCHEMA, "temperature": 1.0, "max_new_tokens": 64} if i % 3 else
                  {"regex": PATTERN, "temperature": 1.0, "max_new_tokens": 32} for i in range(12)]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for i, out in enumerate(outs):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            if i % 3:
                assert _matches_schema(json.loads(out["text"]))
            else:
                assert regex.fullmatch(PATTERN, out["text"])
    finally:
        engine.shutdown()
