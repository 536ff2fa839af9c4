"""Tensor parallelism over torch.distributed (gloo on CPU): how a model splits across ranks, and
real `radixlm serve --tp-size 2` processes (one node, and two "nodes" on this machine) giving
the same greedy outputs as one rank, with the radix cache, chunked prefill and streaming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from radixlm.srt.configs import ModelConfig
from radixlm.srt.executor.models.sharding import ShardPlan, check_tp_size
from benchmarks.harness import ServerProcess, free_port, pid_alive, wait_until

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away,",
           "List three colors:\n1."]
# Longer than the TP server's prefill chunk (128 tokens): prefilled in three steps.
LONG_PROMPT = " ".join(f"item {i}," for i in range(80)) + " and the next item is"


def _config(heads: int, kv_heads: int, **kw) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=heads * 8, intermediate_size=96,
                  num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5,
                  rope_theta=1e4, context_len=256, tie_word_embeddings=True)
    return ModelConfig(**{**fields, **kw})


def test_heads_split_by_kv_group_unevenly_when_they_must():
    # SmolLM2-135M: 9 heads over 3 KV heads on 2 ranks: 1 KV group and 2, their query heads along.
    cfg = _config(9, 3)
    plans = [ShardPlan.for_rank(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 3)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 9)]
    assert [p.intermediate for p in plans] == [(0, 48), (48, 96)]
    # The vocabulary in equal blocks, the last one short (padded in the model).
    plans3 = [ShardPlan.for_rank(cfg, r, 3) for r in range(3)]
    assert [p.vocab for p in plans3] == [(0, 334), (334, 668), (668, 1000)] and plans3[0].vocab_block == 334
    local = plans[1].local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (6, 2, 48, 1000)


def test_kv_heads_replicate_when_fewer_than_ranks():
    cfg = _config(8, 2)
    plans = [ShardPlan.for_rank(cfg, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # The checkpoint pieces each rank reads: its q rows, its KV head's rows, its o_proj columns.
    assert plans[1].pieces("model.layers.0.self_attn.q_proj.weight") == [(0, 16, 32)]
    assert plans[1].pieces("model.layers.0.self_attn.k_proj.weight") == [(0, 0, 8)]
    assert plans[3].pieces("model.layers.0.self_attn.o_proj.weight") == [(1, 48, 64)]
    assert plans[2].pieces("model.layers.0.mlp.down_proj.weight") == [(1, 48, 72)]
    assert plans[0].pieces("model.layers.0.input_layernorm.weight") is None
    # A row-parallel bias is added once: rank 0 holds it, the others zeros.
    assert plans[0].pieces("model.layers.0.self_attn.o_proj.bias") is None
    assert plans[1].pieces("model.layers.0.self_attn.o_proj.bias") == []


@pytest.mark.parametrize("heads,kv_heads,size,why", [
    (9, 3, 4, "does not split 9 attention heads with 3 KV heads"),
    (8, 2, 16, "16 ranks for 8 attention heads"),
    (8, 2, 6, "does not split 8 attention heads with 2 KV heads"),
])
def test_a_tp_size_the_heads_cannot_take_is_refused(heads, kv_heads, size, why):
    with pytest.raises(ValueError, match=why):
        check_tp_size(_config(heads, kv_heads), size)


def test_an_absent_rank_is_named_when_the_rendezvous_times_out():
    from radixlm.srt.executor.parallel import _rendezvous

    port = free_port()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1, 2\] of 3 did not join .* within 1s"):
        _rendezvous("127.0.0.1", port, 0, 3, timeout=1.0)
    assert time.monotonic() - started < 10


def test_followers_tables_match_rank0s_rows_whatever_the_policy_wrote():
    """Random admissions (prefixes written at once), appends, one-slot-each decode writes and
    truncations; every batch's rows, as a follower rebuilds them from the deltas, equal rank
    0's table up to their lengths."""
    import numpy as np

    from radixlm.srt.executor.parallel import TensorParallel
    from radixlm.srt.executor.step_broadcast import StepSender
    from radixlm.srt.scheduler.kv_memory import ReqToTokenTable

    rng = np.random.default_rng(0)
    table = ReqToTokenTable(8, 64)
    sender = StepSender(TensorParallel(), table.table, torch.device("cpu"))
    sender.dirty_from = table.dirty_from
    follower = np.zeros_like(table.table)
    lengths = np.zeros(8, dtype=np.int64)
    sent = 0
    for _ in range(400):
        row = int(rng.integers(8))
        op = rng.integers(4)
        if op == 0:  # a new request on the row, with a cached prefix
            n = int(rng.integers(0, 20))
            table.write(row, 0, rng.integers(1, 10**6, n).tolist())
            lengths[row] = n
        elif op == 1 and lengths[row] < 60:  # new tokens
            n = int(rng.integers(1, 4))
            table.write(row, int(lengths[row]), rng.integers(1, 10**6, n).tolist())
            lengths[row] += n
        elif op == 2:  # rejected drafts: the length shrinks, later writes reuse the positions
            lengths[row] = int(rng.integers(0, lengths[row] + 1))
        else:  # a decode step for a few rows: one slot each, then the batch goes out
            rows = np.unique(rng.integers(8, size=3))
            rows = rows[lengths[rows] < 60]
            table.write_each(rows, lengths[rows], rng.integers(1, 10**6, len(rows)))
            lengths[rows] += 1
            deltas = sender._table_deltas(rows.tolist(), lengths[rows].tolist()).reshape(-1, 3)
            follower[deltas[:, 0], deltas[:, 1]] = deltas[:, 2]
            sent += len(deltas)
            for r in rows:
                assert (follower[r, :lengths[r]] == table.table[r, :lengths[r]]).all()
    assert 0 < sent < 400 * 20  # new entries only, not whole rows every step


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
def test_an_engine_over_two_ranks_speculates_as_one_rank_decodes(engine, algorithm):
    """Engine(tp_size=2) (its other rank a child process) with n-gram or suffix speculation on
    pages of 4: rejected drafts' slots are freed and their table positions written again, and
    the other rank's table follows; greedy outputs equal the plain one-rank Engine's."""
    from radixlm.srt import Engine

    doc = "Name: Alice Smith. Age: 34. City: Paris. Job: engineer. " * 3
    prompts = [doc + "\nRepeat the record exactly:\n", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]
    params = {"max_new_tokens": 40, "temperature": 0}
    expected = [o["output_ids"] for o in engine.generate(prompts, params)]
    tp2 = Engine(tp_size=2, max_total_tokens=8192, speculative_algorithm=algorithm, page_size=4)
    try:
        outs = tp2.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == expected
        assert all(0 < o["meta_info"]["spec_verify_ct"] < 40 for o in outs)  # verified, drafts accepted
        tp2.flush_cache()
        assert tp2.scheduler.kv_stats()["leaked"] == 0
    finally:
        tp2.shutdown()


@pytest.mark.slow
def test_an_engine_over_two_ranks_drafts_with_a_whole_model_on_rank_0(engine):
    """--speculative-algorithm draft under tp_size=2: the target runs over both ranks, the draft
    (the default model itself, so most drafts are accepted) whole on rank 0 with its KV in the
    same slots; greedy outputs equal the plain one-rank Engine's, and no KV slot leaks."""
    from radixlm.srt import Engine
    from radixlm.srt.executor.model_loader import default_model_path

    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
    params = {"max_new_tokens": 24, "temperature": 0}
    expected = [o["output_ids"] for o in engine.generate(prompts, params)]
    tp2 = Engine(tp_size=2, max_total_tokens=8192, speculative_algorithm="draft",
                 speculative_draft_model_path=default_model_path(), speculative_num_steps=4)
    try:
        outs = tp2.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == expected
        assert all(0 < o["meta_info"]["spec_verify_ct"] < 16 for o in outs)  # verified, drafts accepted
        tp2.flush_cache()
        assert tp2.scheduler.kv_stats()["leaked"] == 0
    finally:
        tp2.shutdown()


def _generate(base_url: str, text, **params) -> list[dict]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0, **params}}
    out = httpx.post(f"{base_url}/generate", json=body, timeout=300).json()
    return out if isinstance(out, list) else [out]


def _greedy(base_url: str) -> list[list[int]]:
    return [r["output_ids"] for r in _generate(base_url, PROMPTS)]


@pytest.fixture(scope="module")
def tp2_server():
    srv = ServerProcess("--max-total-tokens", "16384", "--tp-size", "2", "--chunked-prefill-size", "128")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_tp2_gives_the_greedy_outputs_of_one_rank(server, tp2_server):
    assert _greedy(tp2_server.base_url) == _greedy(server.base_url)
    # A prompt prefilled in two chunks, then again from the radix cache: the same tokens.
    first = _generate(tp2_server.base_url, LONG_PROMPT, max_new_tokens=12)[0]
    again = _generate(tp2_server.base_url, LONG_PROMPT, max_new_tokens=12)[0]
    reference = _generate(server.base_url, LONG_PROMPT, max_new_tokens=12)[0]
    assert first["meta_info"]["prompt_tokens"] > 256
    assert again["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1
    assert first["output_ids"] == again["output_ids"] == reference["output_ids"]
    info = httpx.get(f"{tp2_server.base_url}/get_server_info", timeout=30).json()
    assert info["kv"]["leaked"] == 0 and info["num_running_reqs"] == 0


@pytest.mark.slow
def test_tp2_streams_and_samples(server, tp2_server):
    body = {"text": PROMPTS[2], "stream": True, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    ids = []
    with httpx.stream("POST", f"{tp2_server.base_url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids = json.loads(line[6:])["output_ids"]
    assert ids == _generate(server.base_url, PROMPTS[2], max_new_tokens=16)[0]["output_ids"]
    # Seeded sampling: only rank 0 samples, from logits gathered over both vocabulary blocks.
    seeded = dict(temperature=0.8, seed=7, max_new_tokens=16)
    assert _generate(tp2_server.base_url, PROMPTS[0], **seeded)[0]["output_ids"] == \
        _generate(server.base_url, PROMPTS[0], **seeded)[0]["output_ids"]


@pytest.mark.slow
def test_two_nodes_serve_the_same_outputs_and_node1_leaves_with_node0(server, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--max-total-tokens", "16384"]
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "radixlm.srt.launch", *common, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        node0 = ServerProcess(*common, "--node-rank", "0")
        try:
            assert _greedy(node0.base_url) == _greedy(server.base_url)
        finally:
            assert node0.stop() == 0
        assert node1.wait(60) == 0  # rank 0 said stop; node 1 exits cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_server_instead_of_hanging_it(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--max-total-tokens", "4096",
              "--dist-timeout", "10"]
    node1 = subprocess.Popen([sys.executable, "-m", "radixlm.srt.launch", *common, "--node-rank", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    node0 = ServerProcess(*common, "--node-rank", "0")
    try:
        assert _generate(node0.base_url, PROMPTS[0], max_new_tokens=4)[0]["meta_info"]["completion_tokens"] == 4
        ranks = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(node1.pid)], capture_output=True,
                                                     text=True).stdout.split()]
        node1.kill()  # its rank exits within a second (it watches its parent)
        node1.wait(30)
        assert wait_until(lambda: not any(pid_alive(pid) for pid in ranks), 30)
        started = time.monotonic()
        r = httpx.post(f"{node0.base_url}/generate", timeout=120,
                       json={"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 8}})
        assert time.monotonic() - started < 60
        finish = r.json()["meta_info"]["finish_reason"]  # failed, as other internal errors are
        assert finish["type"] == "abort" and "tensor-parallel step failed" in finish["message"]
        assert node0.proc.wait(60) == 1  # the server exits, it does not serve with half a model
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.kill()


def test_an_unreachable_dist_init_addr_fails_naming_it():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "radixlm.srt.launch", "--tp-size", "2", "--nnodes", "2",
                           "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"tensor parallel rank 1: could not reach the rendezvous at dist_init_addr 127.0.0.1:{port}" in proc.stderr
    assert time.monotonic() - started < 90


@pytest.mark.parametrize("flags,message", [
    (dict(nnodes=2, tp_size=2), "dist_init_addr: required with nnodes > 1"),
    (dict(nnodes=2, tp_size=3, dist_init_addr="h:1"), "nnodes: 2 must be >= 1 and divide tp_size 3"),
    (dict(tp_size=2, node_rank=1), "node_rank: 1 must be between 0 and nnodes - 1"),
    (dict(tp_size=2, dist_init_addr="nohost"), "dist_init_addr: expected host:port"),
])
def test_bad_parallel_flags_are_refused(flags, message):
    from radixlm.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match=message):
        ServerArgs(**flags)


def test_more_ranks_than_gpus_is_refused_before_anything_starts():
    from radixlm.srt.executor.parallel import check_devices
    from radixlm.srt.server_args import ServerArgs

    import torch

    found = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tp_size: {found + 1} ranks over 1 node.* need {found + 1} GPUs on this "
                                         f"node; {found} found"):
        check_devices(ServerArgs(tp_size=found + 1, device="cuda"))
