"""The hierarchical cache on CUDA: host copies are bit-exact through pinned memory and the
staging buffer, and a prefix loaded back from the host gives the greedy output it gave when it
was computed, with CUDA graphs and overlap scheduling on."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_helpers import assert_same_greedy, llama3_tokenizer_path, small_llama_config

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


# (head_dim, host slots, the 1500 host slots copied): two runs in a small tier; and a run that
# crosses byte 256 MiB of a segment whose layers (307 MB each) are no divisor of the driver's
# 256 MiB registration pieces, which CUDA refused as an invalid argument when the pieces
# ignored the layers (HostSegments.piece_bytes).
TIERS = {"two_runs": (128, 2048, list(range(100, 1000)) + list(range(1200, 1800))),
         "registration_edge": (96, 400_000, list(range(349_000, 350_500)))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_host_round_trip_is_bit_exact(dtype, tier, monkeypatch) -> None:
    from radixlm.radix.tiered import KVMove
    from radixlm.srt.executor import host_loads
    from radixlm.srt.executor.host_kv import HostKVPool
    from radixlm.srt.executor.mem_pool import KVPool

    monkeypatch.setattr(host_loads, "CHUNK_BYTES", 256 << 10)  # 6 chunks a layer: the staging ring wraps
    head_dim, host_size, host_slots = TIERS[tier]
    pool = KVPool(4096, 3, 2, head_dim, dtype, "cuda")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(torch.uint8).copy_(torch.randint(0, 120, buf.view(torch.uint8).shape, dtype=torch.uint8))
    host = HostKVPool(pool, host_size, torch.device("cuda"))
    try:
        src = random.Random(0).sample(range(4096), 1500)
        before = [b[:, src].clone() for b in pool.k_buffers + pool.v_buffers]
        host.run([KVMove("d2h", src, host_slots)])
        dst = [s for s in range(4096) if s not in set(src)][:1500]
        host.run([KVMove("h2d", dst, host_slots)])
        loads = host.take_loads()  # copied on the side stream; a forward would scatter them per layer
        for layer in range(3):
            loads.before_layer(layer)
        assert loads.done and host.take_loads() is None
        torch.cuda.synchronize()
        after = [b[:, dst] for b in pool.k_buffers + pool.v_buffers]
        for a, b in zip(before, after):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert host.timings()["h2d_tokens"] == 1500 and host.timings()["h2d_seconds"] > 0
    finally:
        host.close()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return small_llama_config(tmp_path_factory.mktemp("small-llama"))


@pytest.mark.parametrize("settings", [{}, {"page_size": 16}, {"kv_cache_dtype": "fp8_e4m3"}],
                         ids=["page1", "page16", "fp8_kv"])
def test_prefix_from_the_host_gives_the_same_output(config_path, settings) -> None:
    from radixlm.srt import Engine

    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 100000) for _ in range(1500)] for _ in range(6)]
    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=4096,
                    max_running_requests=8, enable_hierarchical_cache=True, hicache_ratio=4, **settings)
    try:
        lp = {"return_logprob": True, "top_logprobs_num": 2}
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY, **lp)  # 6 x 1500 > the pool
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY, **lp)
        host = sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again)
        assert host >= 3 * 1400, [o["meta_info"]["cached_tokens_details"] for o in again]
        assert_same_greedy(first, again)
        engine.scheduler.tree.check_invariants()
        kv = engine.scheduler.kv_stats()
        assert kv["leaked"] == 0 and kv["held_by_requests"] == 0, kv
        assert engine.scheduler.server_info()["cache_tiers"]["host"]["load_seconds"] > 0
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()
