"""The engine on CUDA: greedy outputs agree across attention backends and with CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_helpers import assert_same_greedy, first_divergence, llama3_tokenizer_path, small_llama_config

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(1000, 100000) for _ in range(300)]  # a prefix the radix cache shares
    prompts = [shared + [rng.randrange(1000, 100000) for _ in range(n)] for n in (1, 7, 40, 129)]
    prompts += [[rng.randrange(1000, 100000) for _ in range(n)] for n in (3, 64, 500, 1000)]
    return prompts


def _run(config_path: str, logprobs: bool = True, **kwargs) -> list[dict]:
    """Requests with logprobs run their steps in lockstep; without, overlapped (the default)."""
    from radixlm.srt import Engine

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=32768,
                    max_running_requests=16, **kwargs)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    try:
        prompts = _prompts()
        # Twice: the second pass hits the radix cache for every prompt (prefix reuse + decode).
        outs = engine.generate(input_ids=prompts, sampling_params=params, **lp)
        outs += engine.generate(input_ids=prompts[::-1], sampling_params=params, **lp)[::-1]
        assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in outs)
        assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)
        assert engine.scheduler.kv_stats()["leaked"] == 0
        return outs
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return small_llama_config(tmp_path_factory.mktemp("small-llama"))


@pytest.fixture(scope="module")
def reference(config_path):
    return _run(config_path, attention_backend="torch_native", disable_cuda_graph=True)


@pytest.mark.parametrize("kwargs", [
    {"attention_backend": "flashinfer", "disable_cuda_graph": True},
    {"attention_backend": "flashinfer"},
    {"attention_backend": "flashinfer", "page_size": 16},
], ids=["flashinfer-eager", "flashinfer-cuda-graph", "flashinfer-cuda-graph-page16"])
def test_greedy_outputs_match_torch_native(config_path, reference, kwargs):
    assert_same_greedy(reference, _run(config_path, **kwargs))


def test_defaults_on_cuda_are_flashinfer_bf16_with_graphs(config_path):
    from radixlm.srt import Engine

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=8192,
                    max_running_requests=4)
    try:
        runner = engine.scheduler.engine.runner
        assert runner.attention_backend_name == "flashinfer" and runner.dtype == torch.bfloat16
        assert runner.graph_runner is not None and runner.graph_runner.buckets == [1, 2, 4]
        assert all(list(variants) == ["decode"] for variants in runner.graph_runner.graphs.values())
        assert runner.ops.name == "triton"
        out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 8
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs", [{}, {"disable_cuda_graph": True}], ids=["cuda-graph", "eager"])
def test_overlap_schedule_keeps_greedy_outputs(config_path, reference, kwargs):
    assert_same_greedy(reference, _run(config_path, logprobs=False, **kwargs))


def test_overlap_schedule_stops_at_a_stop_token(config_path, reference):
    """A request that stops on a token has one more step launched before the host sees it: that
    token is dropped and its memory freed."""
    from radixlm.srt import Engine

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=32768,
                    max_running_requests=16)
    try:
        assert engine.scheduler.overlap
        prompts = _prompts()
        refs = reference[:len(prompts)]
        stops = [ref["output_ids"][10] for ref in refs]
        params = [{"temperature": 0, "max_new_tokens": NEW_TOKENS, "stop_token_ids": [t]} for t in stops]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for ref, out, stop in zip(refs, outs, stops):
            want = ref["output_ids"][:ref["output_ids"].index(stop) + 1]
            if first_divergence(want, out["output_ids"]) is None:
                assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert engine.scheduler.kv_stats()["leaked"] == 0 and not engine.scheduler.has_work
    finally:
        engine.shutdown()
