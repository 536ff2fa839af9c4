"""LoRA serving (--enable-lora): each adapter's answers equal HF transformers + PEFT with that
adapter, a batch mixing adapters and the base model equals each request alone, prefixes are
cached within an adapter and never across, and adapters load and unload under traffic without
losing a request. Adapters are made with `peft` here, their weights random (PEFT starts B at
zero, which would hide every error)."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from benchmarks.harness import ServerProcess
from radixlm.srt import Engine
from test_model_families import PROMPTS, _build, _hf_greedy, _hf_logprobs

LOGPROB_TOL = 2e-3
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def make_adapter(base: torch.nn.Module, path: Path, seed: int, **config) -> torch.nn.Module:
    """A PEFT LoRA adapter of `base` with random A and B saved to `path`; returns the PEFT
    model (base + adapter), the reference the server is checked against."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.05 if "lora_B" in name else 0.1)
    model.save_pretrained(path)
    return model.eval()


def _ours(out: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


# ---- tiny random families, in-process ---------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tokenizer, tmp_path_factory):
    """A tiny random model, three adapters of it (all projections rank 8; q and v rank 4 with
    rsLoRA; MLP only rank 2) and an Engine serving them."""
    root = tmp_path_factory.mktemp(request.param)
    base = _build(request.param, tokenizer, root / "base")
    refs = {None: base,
            "all": make_adapter(base, root / "all", 1, r=8, lora_alpha=16, target_modules="all-linear"),
            "qv": make_adapter(base, root / "qv", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               use_rslora=True),
            "mlp": make_adapter(base, root / "mlp", 3, r=2, lora_alpha=2,
                                target_modules=["gate_proj", "up_proj", "down_proj"])}
    engine = Engine(model_path=str(root / "base"), max_total_tokens=4096, enable_lora=True,
                    lora_paths=[f"{name}={root / name}" for name in refs if name], max_loras_per_batch=2)
    yield engine, refs, root
    engine.shutdown()


def test_each_adapter_matches_hf_peft(family, tokenizer):
    engine, refs, _ = family
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        for name, ref in refs.items():
            out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                                  lora_path=name)
            assert (_ours(out) - _hf_logprobs(ref, ids)).abs().max().item() <= LOGPROB_TOL, name
            assert out["output_ids"] == _hf_greedy(ref, ids), name
    # The adapters change the answers (a test of adapters that did nothing would pass the above).
    ids = tokenizer.encode(PROMPTS[0])
    plain = _hf_logprobs(refs[None], ids)
    assert all((_hf_logprobs(refs[n], ids) - plain).abs().max() > 0.05 for n in ("all", "qv", "mlp"))


def test_mixed_batch_equals_each_alone_with_fewer_slots_than_adapters(family, tokenizer):
    """Three adapters and the base model in one call on two device slots: requests wait for a
    slot, slots change hands, and each answer is the one it gets alone."""
    engine, refs, _ = family
    ids = tokenizer.encode(PROMPTS[1])
    names = ["all", None, "qv", "mlp", "all", None, "mlp", "qv"]
    params = {"max_new_tokens": 8, "temperature": 0}
    engine.flush_cache()
    alone = {n: engine.generate(input_ids=ids, sampling_params=params, lora_path=n, return_logprob=True)
             for n in refs}
    engine.flush_cache()
    mixed = engine.generate(input_ids=[ids] * len(names), sampling_params=params, lora_path=names,
                            return_logprob=True)
    for name, out in zip(names, mixed):
        assert out["output_ids"] == alone[name]["output_ids"], name
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([e[0] for e in alone[name]["meta_info"]["output_token_logprobs"]])
        assert (got - want).abs().max().item() <= 1e-4, name
    info = engine.scheduler.server_info()
    assert info["kv"]["leaked"] == 0 and info["lora"]["pinned_slots"] == 0


def test_prefixes_are_shared_within_an_adapter_never_across(family, tokenizer):
    engine, _, _ = family
    ids = tokenizer.encode(PROMPTS[0])
    engine.flush_cache()
    params = {"max_new_tokens": 1, "temperature": 0}

    def cached(name, salt=None):
        return engine.generate(input_ids=ids, sampling_params=params, lora_path=name,
                               cache_salt=salt)["meta_info"]["cached_tokens"]

    assert cached("all") == 0
    assert cached("all") == len(ids) - 1  # the same adapter hits its own prefix
    assert cached("qv") == 0 and cached(None) == 0 and cached("all", salt="tenant-b") == 0
    assert cached("qv") == len(ids) - 1 and cached(None) == len(ids) - 1


def test_adapters_load_and_unload_in_process(family, tokenizer, tmp_path):
    engine, refs, root = family
    ids = tokenizer.encode(PROMPTS[0])
    late = make_adapter(refs[None], tmp_path / "late", 9, r=4, lora_alpha=4, target_modules=["o_proj"])
    engine.load_lora_adapter("late", str(tmp_path / "late"))
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                          lora_path="late")
    assert (_ours(out) - _hf_logprobs(late, ids)).abs().max().item() <= LOGPROB_TOL
    with pytest.raises(ValueError, match="already"):
        engine.load_lora_adapter("late", str(tmp_path / "late"))
    engine.unload_lora_adapter("late")
    with pytest.raises(ValueError, match="lora_path: adapter 'late' is not loaded"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="late")


@pytest.mark.parametrize("change, message", [
    ({"r": 16, "lora_alpha": 16}, "rank 16 is above --max-lora-rank 8"),
    ({"use_dora": True}, "DoRA is not implemented"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not implemented"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens are not implemented"),
])
def test_unsupported_adapters_are_refused_by_name(family, tmp_path, change, message):
    engine, _, root = family
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((root / "qv" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (bad / "adapter_model.safetensors").write_bytes((root / "qv" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=message):
        engine.load_lora_adapter("bad", str(bad))
    assert "bad" not in engine.scheduler.server_info()["lora"]["loaded"]


def test_an_adapter_of_another_base_model_is_refused(family, tokenizer, tmp_path):
    engine, _, _ = family
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tokenizer)))
    make_adapter(other, tmp_path / "other", 4, r=4, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"has shape \(4, 32\), the base model needs \(4, 64\)"):
        engine.load_lora_adapter("other", str(tmp_path / "other"))


def test_adapters_split_over_two_ranks_match_hf_peft(tokenizer, tmp_path):
    """Tensor parallelism (2 ranks, gloo): each rank holds its part of every adapter (B cut by
    rows for q/k/v/gate/up, A by columns for o/down); an adapter loaded while serving reaches
    the other rank with the step that first uses it, an unloaded one leaves it."""
    base = _build("llama", tokenizer, tmp_path / "base")
    refs = {None: base,
            "all": make_adapter(base, tmp_path / "all", 1, r=8, lora_alpha=16, target_modules="all-linear"),
            "mlp": make_adapter(base, tmp_path / "mlp", 3, r=2, lora_alpha=2,
                                target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"])}
    engine = Engine(model_path=str(tmp_path / "base"), max_total_tokens=4096, tp_size=2, enable_lora=True,
                    lora_paths=[f"all={tmp_path / 'all'}"], max_lora_rank=8, max_loras_per_batch=2)
    try:
        engine.load_lora_adapter("mlp", str(tmp_path / "mlp"))
        ids = tokenizer.encode(PROMPTS[1])
        names = ["all", None, "mlp"]
        outs = engine.generate(input_ids=[ids] * 3, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0, lora_path=names)
        for name, out in zip(names, outs):
            assert (_ours(out) - _hf_logprobs(refs[name], ids)).abs().max().item() <= LOGPROB_TOL, name
            assert out["output_ids"] == _hf_greedy(refs[name], ids), name
        engine.unload_lora_adapter("mlp")
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="all")
        assert out["output_ids"] == _hf_greedy(refs["all"], ids)
    finally:
        engine.shutdown()


def test_adapter_prefixes_come_back_from_the_disk_tier_in_their_own_namespace(tokenizer, tmp_path):
    """With the hierarchical cache, each adapter's prefix is demoted and read back from disk
    under its own namespace (the adapter files' digest is in the blocks' keys): the answers are
    those computed cold, and no tier leaks a slot."""
    base = _build("llama", tokenizer, tmp_path / "base")
    for i, name in enumerate(("a", "b")):
        make_adapter(base, tmp_path / name, 20 + i, r=4, lora_alpha=8, target_modules="all-linear")
    engine = Engine(model_path=str(tmp_path / "base"), max_total_tokens=256, enable_lora=True,
                    lora_paths=[f"{n}={tmp_path / n}" for n in ("a", "b")], enable_hierarchical_cache=True,
                    hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "disk"))
    try:
        ids = tokenizer.encode(PROMPTS[0]) * 2
        params = {"max_new_tokens": 4, "temperature": 0}
        cold = {n: engine.generate(input_ids=ids, sampling_params=params, lora_path=n)["output_ids"]
                for n in ("a", "b", None)}
        for i in range(6):  # other prompts push them out of the 256-token pool
            engine.generate(input_ids=[i + 5] * 100, sampling_params=params)
        for name in ("a", "b", None):
            out = engine.generate(input_ids=ids, sampling_params=params, lora_path=name)
            assert out["output_ids"] == cold[name], name
            assert out["meta_info"]["cached_tokens"] > 0, name
        assert engine.scheduler.kv_stats()["leaked"] == 0
    finally:
        engine.shutdown()


def test_settings_refuse_what_lora_does_not_do(tmp_path):
    from radixlm.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="lora_paths: needs --enable-lora"):
        ServerArgs(lora_paths=["a=/x"])
    with pytest.raises(ValueError, match="max_lora_rank: required"):
        ServerArgs(enable_lora=True)
    with pytest.raises(ValueError, match="lora_backend: 'csgmv' is not implemented \\(auto, triton and torch are"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_backend="csgmv")
    with pytest.raises(ValueError, match="lora_target_modules: lm_head not implemented"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules=["lm_head"])
    with pytest.raises(ValueError, match="enable_lora: with --enable-deterministic-inference is not implemented"):
        from radixlm.srt.lora.layers import check_lora_supported

        check_lora_supported(ServerArgs(enable_lora=True, max_lora_rank=8, enable_deterministic_inference=True),
                             None)
    with pytest.raises(ValueError, match="lora_backend: triton needs a CUDA device"):
        check_lora_supported(ServerArgs(enable_lora=True, max_lora_rank=8, lora_backend="triton", device="cpu"), None)


def test_requests_name_only_loaded_adapters(engine):
    """The shared default-model Engine runs without --enable-lora: naming an adapter is an error."""
    with pytest.raises(ValueError, match="lora_path: 'x' names an adapter, but the server runs without"):
        engine.generate("Hi", {"max_new_tokens": 1}, lora_path="x")


# ---- the default model behind a real server -----------------------------------------------------

ADAPTERS = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def lora_server(hf_model, tmp_path_factory):
    """`radixlm serve` on the default model with four random rank-8 adapters and a budget of
    five loaded adapters; the PEFT references of two of them beside it."""
    from benchmarks.bench_lora import write_adapter
    from radixlm.srt.configs import ModelConfig

    root = tmp_path_factory.mktemp("adapters")
    # PEFT makes the two the answers are checked against; the others are written directly.
    refs = {"a": make_adapter(hf_model, root / "a", 10, r=8, lora_alpha=16, target_modules="all-linear"),
            "c": make_adapter(hf_model, root / "c", 12, r=8, lora_alpha=16, target_modules=["o_proj", "down_proj"])}
    config = ModelConfig.from_hf(hf_model.config)
    for seed, name in enumerate(("b", "d", "e", "f")):
        write_adapter(root / name, config, 8, seed, std=0.08)
    srv = ServerProcess("--max-total-tokens", "16384", "--enable-lora", "--max-loaded-loras", "5",
                        "--lora-paths", *[f"{n}={root / n}" for n in ADAPTERS])
    yield srv, refs, root
    srv.stop()


def test_server_answers_equal_hf_peft_on_the_default_model(lora_server, tokenizer):
    srv, refs, _ = lora_server
    ids = tokenizer.encode(PROMPTS[0])
    with srv.client() as http:
        for name in ("a", "c"):
            out = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": name,
                                                "return_logprob": True, "logprob_start_len": 0}).json()
            assert (_ours(out) - _hf_logprobs(refs[name], ids)).abs().max().item() <= LOGPROB_TOL, name
            assert out["output_ids"] == _hf_greedy(refs[name], ids), name


def test_openai_model_names_select_the_adapter(lora_server):
    srv, _, _ = lora_server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    listed = {m.id for m in client.models.list().data}
    assert listed == {"default", *ADAPTERS}
    prompt = "The capital of France is"
    with srv.client() as http:
        native = {name: http.post("/generate", json={"text": prompt, "sampling_params": GREEDY,
                                                      "lora_path": name}).json()["text"] for name in (None, "b")}
    assert native["b"] != native[None]
    for model, name in (("b", "b"), ("default:b", "b"), ("default", None)):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert reply.choices[0].text == native[name] and reply.model == (name or "default"), model
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "b" and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="model: 'zzz' does not exist"):
        client.completions.create(model="zzz", prompt=prompt, max_tokens=1)


def test_unknown_adapter_is_a_400_naming_lora_path(lora_server):
    srv, _, _ = lora_server
    with srv.client() as http:
        r = http.post("/generate", json={"text": "Hi", "lora_path": "nope"})
        assert r.status_code == 400 and "lora_path: adapter 'nope' is not loaded" in r.text
        r = http.post("/generate", json={"text": ["Hi", "Yo"], "lora_path": ["a"]})
        assert r.status_code == 400 and "lora_path: a list must have one entry per prompt" in r.text
        r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
        assert r.status_code == 400 and "no adapter_config.json" in r.text
        assert http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_load_and_unload_under_traffic_lose_no_request(lora_server, tokenizer):
    """Streams run on adapter d while it is unloaded and adapter e loaded: every stream ends with
    its whole answer, the unload waits for them, then d is refused and e answers; a sixth
    adapter over --max-loaded-loras 5 gets 503."""
    srv, _, root = lora_server
    results: list[dict] = []

    def stream_on_d() -> None:
        with srv.client() as http:
            body = {"text": "Once upon a time", "lora_path": "d", "stream": True,
                    "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
            last = None
            with http.stream("POST", "/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        last = json.loads(line[5:])
            results.append(last)

    threads = [threading.Thread(target=stream_on_d) for _ in range(4)]
    for t in threads:
        t.start()
    with srv.client() as http:
        # Wait until the streams run, so the unload really has requests to wait for.
        deadline = time.monotonic() + 60
        while http.get("/get_server_info").json()["lora"]["pinned_slots"] == 0:
            assert time.monotonic() < deadline
        assert http.post("/load_lora_adapter", json={"lora_name": "e", "lora_path": str(root / "e")}).status_code == 200
        unloaded = http.post("/unload_lora_adapter", json={"lora_name": "d"})
        for t in threads:
            t.join()
        assert unloaded.status_code == 200, unloaded.text
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 4
        assert all(r["meta_info"]["completion_tokens"] == 48 for r in results)
        assert http.post("/generate", json={"text": "Hi", "lora_path": "d"}).status_code == 400
        assert http.post("/generate", json={"text": "Hi", "lora_path": "e",
                                            "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        full = http.post("/load_lora_adapter", json={"lora_name": "f", "lora_path": str(root / "f")})
        over = http.post("/load_lora_adapter", json={"lora_name": "g", "lora_path": str(root / "f")})
        assert full.status_code == 200 and over.status_code == 503 and "max_loaded_loras: 5" in over.text
        info = http.get("/get_server_info").json()
        assert info["kv"]["leaked"] == 0 and info["lora"]["pinned_slots"] == 0
        metrics = http.get("/metrics").text
        assert "radixlm_lora_adapters_loaded 5.0" in metrics and "radixlm_lora_slots_in_use 0.0" in metrics


def test_language_programs_and_calls_name_their_adapter(lora_server):
    """`gen(lora_path=...)` and `select(lora_path=...)` per call, `run(lora_path=...)` for a whole
    program, and run_batch mixing adapters through a program argument: each gen answers as the
    native API does on that adapter."""
    import radixlm as sgl

    srv, _, _ = lora_server
    backend = sgl.RuntimeEndpoint(srv.base_url)
    question = "Q: What is two plus two?\nA:"
    adapters = [None, "a", "b", "a"]

    @sgl.function
    def answer(s, adapter):
        s += question + sgl.gen("answer", max_tokens=12, temperature=0, lora_path=adapter)
        s += "\nCorrect?" + sgl.select("verdict", choices=[" yes", " no"], lora_path=adapter)

    states = answer.run_batch([{"adapter": a} for a in adapters], backend=backend)
    with srv.client() as http:
        for state, adapter in zip(states, adapters):
            want = http.post("/generate", json={"text": question, "sampling_params": GREEDY,
                                                "lora_path": adapter}).json()["text"]
            assert state["answer"] == want, adapter
    assert states[0]["answer"] != states[1]["answer"] != states[2]["answer"]
    assert states[1]["answer"] == states[3]["answer"]
    scores = [state.get_meta_info("verdict")["normalized_prompt_logprobs"] for state in states]
    # Rows batched with other companions round otherwise in float32 (about 1e-6 relative); another
    # adapter moves the score by far more.
    assert scores[1] == pytest.approx(scores[3], rel=1e-4) and scores[0] != pytest.approx(scores[1], rel=1e-4)

    @sgl.function
    def plain(s):
        s += question + sgl.gen("answer", max_tokens=12, temperature=0)

    assert plain.run(backend=backend, lora_path="b")["answer"] == states[2]["answer"]
    assert plain.run(backend=backend)["answer"] == states[0]["answer"]


def test_slots_go_to_idle_adapters_and_forget_unloaded_ones():
    """The policy's slot table alone: pinned slots stay, the least recently used idle one goes
    to the next adapter, and an unloaded adapter's queued copy is dropped with it."""
    from radixlm.srt.core.request import Req
    from radixlm.srt.lora.slots import AdapterSlots, LoadedAdapter
    from radixlm.srt.sampling_params import SamplingParams

    slots = AdapterSlots(2)
    for name in "xyz":
        slots.register(LoadedAdapter(name, "uid-" + name))

    def req(name):
        r = Req(rid=name, origin_input_ids=[1], sampling_params=SamplingParams())
        r.adapter_name, r.adapter_uid = name, "uid-" + name
        return r

    rx, ry, rz = req("x"), req("y"), req("z")
    assert slots.acquire(rx) and slots.acquire(ry) and not slots.acquire(rz)  # both slots pinned
    assert slots.take_loads() == [(0, "uid-x"), (1, "uid-y")]
    slots.release(rx)
    assert slots.acquire(rz) and rz.adapter_slot == 0 and slots.take_loads() == [(0, "uid-z")]
    assert slots.acquire(req("y")) and slots.take_loads() == []  # resident: no copy
    slots.release(rz)
    rx2 = req("x")
    assert slots.acquire(rx2) and slots.take_loads() == [(0, "uid-x")]
    slots.release(rx2)
    rz2 = req("z")  # slot 0 goes to z, and the request is not admitted after all
    assert slots.acquire(rz2) and rz2.adapter_slot == 0
    slots.release(rz2)
    slots.unregister("z")  # unloaded before any step ran: its queued copy goes with it
    assert slots.take_loads() == [] and slots.slot_loads == 4
    assert slots.holder == [None, "uid-y"]


def test_triton_kernels_equal_the_masked_products():
    """--lora-backend triton (CUDA), run here by Triton's CPU interpreter: each token's gathered
    product (ranks 6, 3, 5 in slots of rank 6, the rank padded to 8 in the kernel; q and v
    carrying LoRA, k not; two base-model tokens; the input in one K split and in three; parts
    that share a block of output columns and parts aligned to the blocks) equals the torch
    path's masked one."""
    from triton_interpreter import run_in_interpreter

    script = """
import torch
from torch import nn
import radixlm.srt.lora.triton_lora as kernels
from radixlm.srt.lora.layers import BatchAdapters, LoRALinear

torch.manual_seed(0)
S, R, K = 3, 6, 48
worst = 0.0
for widths in ((32, 16, 16), (64, 64, 128)):
    shapes = dict(zip(("q_proj", "k_proj", "v_proj"), ((K, w) for w in widths)))
    batch = BatchAdapters(S, R, "cpu", torch.float32)
    base = nn.Linear(K, sum(widths), bias=False)
    lora = LoRALinear(base, ("q_proj", "k_proj", "v_proj"), shapes, batch)
    for s, r in enumerate([6, 3, 5]):
        lora.write_slot(s, {p: (torch.randn(r, K), torch.randn(shapes[p][1], r)) for p in ("q_proj", "v_proj")})
        batch.set_scaling(s, 0.5 + s, r)
    slots = [0, -1, 2, 1, 2, -1, 0]
    x = torch.randn(len(slots), K)
    batch.prepare(slots)
    batch.triton_max_tokens = 0
    want = lora(x)
    batch.triton_max_tokens = 1 << 30
    for split in (512, 16):  # K of 48 in one split, then in three added in order by the expand
        kernels.K_PER_SPLIT = split
        worst = max(worst, float((lora(x) - want).abs().max() / want.abs().max()))
print(worst)
"""
    assert float(run_in_interpreter(script)) < 1e-6
