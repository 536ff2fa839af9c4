"""Cascade decode attention in the FlashInfer backend, on CUDA: equal to plain FlashInfer decode,
to torch-native attention, and, through the engine, to greedy outputs without cascade."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gpu_helpers import assert_same_greedy, llama3_tokenizer_path, small_llama_config
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.mem_pool import KVPool
from radixlm.srt.scheduler.kv_memory import PageAllocator

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
DTYPE = torch.bfloat16
# (shared prompt tokens, each member's context before the step): group 1's prompt is not a
# multiple of 16 (with pages of 16, its last 13 tokens are each member's own copy), and one of
# its members holds nothing beyond the prompt.
GROUPS = [(300, [301, 317, 340, 305, 600]), (77, [77, 150, 78]), (130, [200, 131])]
# Ungrouped: (tokens shared with group 0's prompt, context). 20 shared tokens is below
# CASCADE_MIN_PREFIX; the others share nothing.
LONE = [(20, 50), (0, 500), (0, 1), (0, 64)]


def _fill(pool, slots: list[int], gen) -> None:
    if not slots:
        return
    idx = torch.tensor(slots, device="cuda")
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf[:, idx] = torch.randn(NUM_KV_HEADS, len(slots), HEAD_DIM, generator=gen, device="cuda").to(DTYPE)


def _layout(alloc, pool, table, page_size: int, gen) -> list[tuple[int, int]]:
    """Writes the groups' and lone requests' KV; returns (table row, context) per request, in a
    shuffled batch order. Shared prompts keep whole pages shared, as the radix cache does."""
    reqs = []
    first_base = None
    for shared, contexts in GROUPS:
        aligned = shared // page_size * page_size
        base = alloc.alloc(0, aligned, None)
        _fill(pool, base, gen)
        first_base = first_base or base
        for n in contexts:
            own = alloc.alloc(aligned, n - aligned, None)
            _fill(pool, own, gen)
            table[len(reqs), :n] = torch.tensor(base + own)
            reqs.append((len(reqs), n))
    for shared, n in LONE:
        aligned = shared // page_size * page_size
        own = alloc.alloc(aligned, n - aligned, None)
        _fill(pool, own, gen)
        table[len(reqs), :n] = torch.tensor(first_base[:aligned] + own)
        reqs.append((len(reqs), n))
    random.Random(page_size).shuffle(reqs)
    return reqs


def _decode_batch(alloc, table, reqs) -> ForwardBatch:
    rows = [r for r, _ in reqs]
    contexts = [n for _, n in reqs]
    slots = []
    for row, n in reqs:
        slot = alloc.alloc(n, 1, int(table[row, n - 1]))
        table[row, n] = slot[0]
        slots += slot
    seq_lens = [n + 1 for n in contexts]
    dev = torch.device("cuda")
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(len(rows), dtype=torch.int64, device=dev),
        positions=torch.tensor(contexts, device=dev), out_cache_loc=torch.tensor(slots, device=dev),
        req_pool_indices=torch.tensor(rows, device=dev), req_pool_indices_cpu=rows,
        seq_lens=torch.tensor(seq_lens, device=dev), seq_lens_cpu=seq_lens, prefix_lens_cpu=contexts,
        extend_lens_cpu=[1] * len(rows), logit_rows=torch.arange(len(rows), device=dev))


@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_decode_matches_plain_flashinfer_and_torch_native(page_size, monkeypatch):
    from radixlm.srt.executor.attention import flashinfer_backend
    from radixlm.srt.executor.attention.flashinfer_backend import FlashInferBackend
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    gen = torch.Generator(device="cuda").manual_seed(page_size)
    alloc = PageAllocator(capacity_tokens=16384, page_size=page_size)
    pool = KVPool(alloc.num_pages * page_size, 1, NUM_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    table = torch.zeros(16, 2048, dtype=torch.int64)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    args = (pool, table, page_size, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale, DTYPE)
    cascade, plain = FlashInferBackend(*args), FlashInferBackend(*args, cascade=False)
    native = TorchNativeBackend(pool, table, scale, cascade=False)  # the plain reference
    reqs = _layout(alloc, pool, table, page_size, gen)
    num_grouped = sum(len(c) for _, c in GROUPS)
    for step in range(3):  # lengths grow across page boundaries
        batch = _decode_batch(alloc, table, reqs)
        # A test-sized batch saves far less than it takes to give up a CUDA graph...
        assert not cascade.prefers_eager(batch)
        # ...or to be worth cascade at all; with the thresholds at zero it cascades.
        monkeypatch.setattr(flashinfer_backend, "CASCADE_GRAPH_MIN_SAVED_BYTES", 0)
        monkeypatch.setattr(flashinfer_backend, "CASCADE_EAGER_MIN_SAVED_BYTES", 0)
        assert cascade.prefers_eager(batch) and not plain.prefers_eager(batch)
        q = torch.randn(len(reqs), NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        k = torch.randn(len(reqs), NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        v = torch.randn(len(reqs), NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        cascade.plan(batch)
        assert cascade._cascade is not None and cascade._cascade.num_grouped == num_grouped
        assert cascade._cascade.order is not None  # shuffled: the step reorders its queries
        got = cascade.forward(q, k, v, 0).float()
        plain.plan(batch)
        assert plain._cascade is None
        want_flash = plain.forward(q, k, v, 0).float()
        native.plan(batch)
        want = native.forward(q.float(), k.float(), v.float(), 0).float()
        torch.testing.assert_close(got, want_flash, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        # Above the eager threshold only: a plain step again.
        monkeypatch.setattr(flashinfer_backend, "CASCADE_EAGER_MIN_SAVED_BYTES", 1 << 40)
        cascade.plan(batch)
        assert cascade._cascade is None
        torch.testing.assert_close(cascade.forward(q, k, v, 0).float(), want_flash, atol=1e-3, rtol=1e-3)
        monkeypatch.undo()
        reqs = [(row, n + 1) for row, n in reqs]


NEW_TOKENS = 16


def _shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(1)
    prompts = []
    for shared_len in (300, 150):  # two few-shot prefixes
        shared = [rng.randrange(1000, 100000) for _ in range(shared_len)]
        prompts += [shared + [rng.randrange(1000, 100000) for _ in range(n)] for n in (3, 17, 40, 90, 5)]
    prompts += [[rng.randrange(1000, 100000) for _ in range(n)] for n in (30, 200)]  # no shared prefix
    return prompts


def _generate(config_path: str, count_cascade: list[int], counted: str = "_plan_cascade", **kwargs) -> list[dict]:
    """Greedy outputs of the shared-prefix prompts; appends to count_cascade on every call of
    the backend's `counted` planner (eager cascade, or the cascade graph's)."""
    from radixlm.srt import Engine

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=32768,
                    max_running_requests=16, attention_backend="flashinfer", **kwargs)
    backend = engine.scheduler.engine.runner.attn_backend
    real_plan = getattr(backend, counted)

    def counting_plan(*a):
        count_cascade.append(1)
        return real_plan(*a)

    setattr(backend, counted, counting_plan)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    try:
        prompts = _shared_prefix_prompts()
        # Cache both prefixes first, so the batch's requests hold the same KV slots for them.
        engine.generate(input_ids=[prompts[0], prompts[5]], sampling_params={"max_new_tokens": 0})
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in outs)
        return outs
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()


# How each test mode forces cascade on the small model's batches (which save far less KV than
# the thresholds ask for), and the backend planner that runs on every such decode step.
CASCADE_MODES = {
    "eager": ({"flashinfer_backend.CASCADE_GRAPH_MIN_SAVED_BYTES": 0,
               "flashinfer_backend.CASCADE_EAGER_MIN_SAVED_BYTES": 0}, "_plan_cascade"),
    # Buckets of 8 and 16 get cascade graphs here (64 and up by default).
    "cuda-graph": ({"flashinfer_graphs.CASCADE_GRAPH_MIN_BS": 8,
                    "flashinfer_graphs.CASCADE_IN_GRAPH_MIN_SAVED_BYTES": 0}, "_plan_graph_cascade"),
}


@pytest.mark.parametrize("mode", list(CASCADE_MODES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_outputs_equal_with_and_without_cascade(tmp_path, monkeypatch, page_size, mode):
    from radixlm.srt.executor.attention import flashinfer_backend, flashinfer_graphs

    modules = {"flashinfer_backend": flashinfer_backend, "flashinfer_graphs": flashinfer_graphs}
    patches, planner = CASCADE_MODES[mode]
    for target, value in patches.items():
        module, name = target.split(".")
        monkeypatch.setattr(modules[module], name, value)
    config_path = small_llama_config(tmp_path)
    cascaded: list[int] = []
    with_cascade = _generate(config_path, cascaded, counted=planner, page_size=page_size)
    assert len(cascaded) >= NEW_TOKENS - 1  # every decode step of the batch had groups
    plain_plans: list[int] = []
    without = _generate(config_path, plain_plans, page_size=page_size, disable_cascade_attention=True)
    assert not plain_plans
    assert_same_greedy(without, with_cascade)

