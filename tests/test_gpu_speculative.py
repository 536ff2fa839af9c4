"""Draft-model speculation on CUDA (FlashInfer, CUDA graphs): verify steps replay the decode
graphs as one row per token, and greedy outputs agree with plain decoding (up to near ties in
bf16). A small random Llama drafts for itself (every draft accepted) or with its first two
layers (dummy weights are seeded by name, so those are the same layers)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_helpers import assert_same_greedy, llama3_tokenizer_path, small_llama_config

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(1000, 100000) for _ in range(200)]
    return [shared + [rng.randrange(1000, 100000) for _ in range(n)] for n in (1, 9, 60)] + \
        [[rng.randrange(1000, 100000) for _ in range(n)] for n in (5, 300)]


def _run(config_path: str, logprobs: bool, **kwargs) -> tuple[list[dict], dict, int]:
    """(outputs, speculative statistics, graph replays of verify batches)."""
    from radixlm.srt import Engine

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=32768,
                    max_running_requests=16, **kwargs)
    graphs = engine.scheduler.engine.runner.graph_runner
    assert graphs is not None
    verify_replays = 0
    replay = graphs.replay

    def counting_replay(batch):
        nonlocal verify_replays
        verify_replays += len(set(batch.req_pool_indices_cpu)) < batch.batch_size  # rows of one request
        return replay(batch)

    graphs.replay = counting_replay
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    try:
        outs = engine.generate(input_ids=_prompts(), sampling_params=params, **lp)
        assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in outs)
        stats = engine.scheduler.kv_stats()
        assert stats["leaked"] == 0 and stats["held_by_requests"] == 0
        return outs, engine.scheduler.spec_stats(), verify_replays
    finally:
        del graphs.replay
        engine.shutdown()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return (small_llama_config(tmp_path_factory.mktemp("target")),
            small_llama_config(tmp_path_factory.mktemp("draft2"), num_layers=2))


@pytest.fixture(scope="module")
def reference(configs):
    return _run(configs[0], logprobs=True)[0]  # logprob requests never speculate: plain decoding


@pytest.mark.parametrize("draft", ["self", "two_layers"])
def test_draft_speculation_on_cuda_graphs(configs, reference, draft):
    target, two_layers = configs
    outs, stats, verify_replays = _run(target, logprobs=False, speculative_algorithm="draft",
                                       speculative_draft_model_path=target if draft == "self" else two_layers,
                                       speculative_num_steps=4)
    assert_same_greedy(reference, outs)
    assert stats["verify_steps"] > 0 and verify_replays > 0
    if draft == "self":
        assert stats["mean_accepted_length"] > 4.0, stats
