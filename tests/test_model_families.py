"""Every supported family against Hugging Face transformers: a tiny random model saved with
`save_pretrained` (safetensors, with the default model's tokenizer), served by the in-process
Engine on CPU in fp32, checked on teacher-forced logprobs and 12 greedy tokens.

Windowed families use a window of 16 tokens with 40-token prompts, prefilled in chunks of 16
(so later chunks attend over cached prefixes longer than the window), decoded past the window,
and re-served from the radix cache; MoE families check that tokens pick different experts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from radixlm.srt import Engine
from radixlm.srt.configs import SUPPORTED_ARCHITECTURES
from radixlm.srt.executor.models.registry import MODEL_CLASSES

from model_helpers import write_stub_gguf

WINDOW = 16
LOGPROB_TOL = 2e-3
FINAL_NORM = 8.0
PROMPTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each of the worn stone "
    "steps while the sea below grew dark and restless under the low grey clouds that had rolled in from the "
    "west before sunset.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n",
]
# Families are built small: 2 layers (3 for Qwen3-MoE: one dense), hidden 64, the tokenizer's vocab.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(kind: str, vocab_size: int):
    import transformers as tf

    shape = dict(SHAPE, vocab_size=vocab_size)
    gemma = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24)
    return {
        "llama": lambda: tf.LlamaConfig(**shape, tie_word_embeddings=True),
        # FlashInfer's smallest head size (test_gpu_lora.py's CUDA graphs)
        "llama_head64": lambda: tf.LlamaConfig(**shape, head_dim=64, tie_word_embeddings=True),
        "llama3_rope": lambda: tf.LlamaConfig(**shape, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "mistral": lambda: tf.MistralConfig(**shape, sliding_window=WINDOW),
        "qwen2": lambda: tf.Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "qwen2_yarn": lambda: tf.Qwen2Config(**shape, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen3": lambda: tf.Qwen3Config(**shape, head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "gemma2": lambda: tf.Gemma2Config(**shape, **gemma, attn_logit_softcapping=5.0, final_logit_softcapping=20.0),
        "gemma3": lambda: tf.Gemma3TextConfig(**shape, **gemma, layer_types=["sliding_attention", "full_attention"],
                                              rope_parameters={
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                     "rope_theta": 1e6}}),
        "phi3": lambda: tf.Phi3Config(**shape, sliding_window=WINDOW, original_max_position_embeddings=128,
                                      rope_scaling={"rope_type": "longrope", "long_factor": [4.0] * 8,
                                                    "short_factor": [1.0 + i / 8 for i in range(8)]}),
        "mixtral": lambda: tf.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**dict(shape, num_hidden_layers=3), head_dim=16, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                               mlp_only_layers=[1]),
    }[kind]()


ARCH_OF = {"llama": "LlamaForCausalLM", "llama3_rope": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen2_yarn": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
           "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
WINDOWED = {"mistral", "qwen2", "gemma2", "gemma3", "phi3", "mixtral"}
MOE_ROUTERS = {"mixtral": "mlp.gate", "qwen3_moe": "mlp.gate"}  # transformers' module names


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())  # converted once into the user cache, then read


def _build(kind: str, tokenizer, path: Path) -> torch.nn.Module:
    """A tiny HF model of `kind` with every tensor random (HF inits norms and biases to
    constants), saved with the tokenizer into `path` as a user's checkpoint directory is."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, len(tokenizer)), attn_implementation="eager").eval()
    # Scales picked so that greedy outputs do not collapse into repeating one token (Gemma
    # multiplies its tied embeddings by sqrt(hidden): they need to start smaller).
    embed_std, std = (0.02, 0.2) if kind.startswith("gemma") else (0.05, 0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1 if "norm" in name else embed_std if "embed" in name else std)
        # A large final norm spreads the logits, so the logprobs compared are far from uniform
        # and an error shows at the tolerance's scale.
        model.model.norm.weight.normal_(0.0, FINAL_NORM)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _engine(path: Path, **kwargs) -> Engine:
    # Chunks of 16: the later chunks of a 40-token prompt attend over cached prefixes longer than the window.
    return Engine(model_path=str(path), max_total_tokens=4096, chunked_prefill_size=WINDOW, **kwargs)


@pytest.mark.parametrize("kind", list(ARCH_OF))
def test_family_matches_hf(kind: str, tokenizer, tmp_path: Path) -> None:
    model = _build(kind, tokenizer, tmp_path)
    engine = _engine(tmp_path, enable_mixed_chunk=True)
    try:
        assert engine.model_config.architecture == ARCH_OF[kind]
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        assert all(len(ids) > 2 * WINDOW for ids in prompts)
        worst = 0.0
        for ids in prompts:
            out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=0)
            ours = torch.tensor([lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]])
            ref = _hf_logprobs(model, ids)
            worst = max(worst, (ours - ref).abs().max().item())
        print(f"{kind}: max |logprob difference| against HF {worst:.2e} (reference logprobs "
              f"{ref.min().item():.1f} .. {ref.max().item():.1f})")
        assert worst <= LOGPROB_TOL

        # Greedy: both prompts batched (decodes of different lengths, one riding in the other's
        # prefill chunks), past the window.
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        expected = [_hf_greedy(model, ids) for ids in prompts]
        assert all(len(set(e)) > 2 for e in expected), f"degenerate reference outputs {expected}"
        engine.flush_cache()
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert got == expected

        # From the radix cache: the first prompt plus its answer is cached (far longer than the
        # window); a continuation of it attends over that cached prefix.
        longer = prompts[0] + expected[0] + prompts[1][:5]
        again = engine.generate(input_ids=longer, sampling_params=params)
        assert again["meta_info"]["cached_tokens"] >= len(prompts[0]) > 2 * WINDOW
        assert again["output_ids"] == _hf_greedy(model, longer)
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"])
def test_family_split_over_two_ranks_matches_hf(kind: str, tokenizer, tmp_path: Path) -> None:
    """Tensor parallelism (2 ranks, gloo) per checkpoint layout: q/k/v biases and windows
    (Qwen2), soft-caps, sandwich norms and scaled embeddings (Gemma 2), per-head q/k norms and
    two rope tables (Gemma 3), fused qkv and gate_up tensors cut per rank (Phi-3), experts split
    by their columns (Mixtral; Qwen3-MoE beside a dense layer)."""
    model = _build(kind, tokenizer, tmp_path)
    engine = _engine(tmp_path, tp_size=2)
    try:
        ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        ours = torch.tensor([lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]])
        assert (ours - _hf_logprobs(model, ids)).abs().max().item() <= LOGPROB_TOL
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == _hf_greedy(model, ids)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_windows_with_pages_of_four(kind: str, tokenizer, tmp_path: Path) -> None:
    """Paged KV (pages of 4 slots, windows not page-aligned at 16 + prompt offsets) gives HF's greedy."""
    model = _build(kind, tokenizer, tmp_path)
    engine = _engine(tmp_path, page_size=4)
    try:
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert got == [_hf_greedy(model, ids) for ids in prompts]
    finally:
        engine.shutdown()


def test_mistral_window_changes_the_answer(tokenizer, tmp_path: Path) -> None:
    """The window test above is not vacuous: without the window, HF's own logprobs differ."""
    import transformers as tf

    model = _build("mistral", tokenizer, tmp_path)
    full = tf.MistralForCausalLM(tf.MistralConfig(**{**model.config.to_dict(), "sliding_window": None})).eval()
    full.load_state_dict(model.state_dict())
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert (_hf_logprobs(model, ids) - _hf_logprobs(full, ids)).abs().max().item() > 10 * LOGPROB_TOL


@pytest.mark.parametrize("kind", list(MOE_ROUTERS))
def test_moe_tokens_pick_different_experts(kind: str, tokenizer, tmp_path: Path) -> None:
    """In the test above the MoE layer really routes: tokens of one prompt pick different experts."""
    model = _build(kind, tokenizer, tmp_path)
    router = model.model.layers[0].get_submodule(MOE_ROUTERS[kind])
    picked: list[torch.Tensor] = []
    router.register_forward_hook(lambda module, args, out: picked.append(out[2]))
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    _hf_logprobs(model, ids)
    top_sets = {tuple(sorted(row.tolist())) for row in picked[0]}
    assert len(set(picked[0][:, 0].tolist())) >= 3 and len(top_sets) >= 3, top_sets


def test_moe_pairs_are_sorted_into_whole_tiles_of_one_expert() -> None:
    """The fused GPU MoE's device-side sort (its kernels run on CUDA only; the sort runs anywhere)."""
    pytest.importorskip("triton")
    from radixlm.srt.executor.models.moe_triton import sort_pairs

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]])  # expert 4 unused
    pairs, tile_expert = sort_pairs(ids, num_experts=5, block_m=4)
    flat, num_pairs = ids.reshape(-1), ids.numel()
    assert sorted(p for p in pairs.tolist() if p < num_pairs) == list(range(num_pairs))
    seen = []
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = pairs[tile * 4:(tile + 1) * 4].tolist()
        real = [p for p in rows if p < num_pairs]
        if expert < 0:
            assert not real
            continue
        assert real and all(flat[p] == expert for p in real) and rows[:len(real)] == real
        seen.append(expert)
    assert seen == [0, 1, 2, 3, 3]  # expert 3 has five pairs: two tiles


def test_every_readable_architecture_has_a_model_class() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == set(MODEL_CLASSES)


@pytest.mark.parametrize("kind", list(ARCH_OF))
def test_dummy_weights_for_every_family(kind: str, tokenizer, tmp_path: Path) -> None:
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.srt.executor.models.registry import model_class

    _config(kind, 1000).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_format="dummy")
    model = model_class(loaded.config)(loaded.config, loaded.hf_config)
    model.load_weights(loaded.weights)  # every parameter covered exactly once


# ---------------------------------------------------------------- refusals, by name


def _write_config(path: Path, **fields) -> Path:
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("arch", ["Gemma3ForConditionalGeneration", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_unknown_architecture_is_refused_by_name(arch: str, tmp_path: Path) -> None:
    from radixlm.srt.executor.model_loader import load_model

    _config("llama", 1000).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    _write_config(tmp_path, **{**fields, "architectures": [arch]})
    with pytest.raises(ValueError, match=f"architecture '{arch}' is not supported"):
        load_model(tmp_path, load_format="dummy")


@pytest.mark.parametrize(("option", "message"), [
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope type 'proportional' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"attention_chunk_size": 8}, "attention_chunk_size"),
])
def test_unimplemented_option_is_refused_by_name(option: dict, message: str, tmp_path: Path) -> None:
    from radixlm.srt.executor.model_loader import load_model

    _config("llama", 1000).save_pretrained(tmp_path)
    fields = {**json.loads((tmp_path / "config.json").read_text()), **option}
    fields.pop("rope_parameters", None) if "rope_scaling" in option else None
    _write_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, load_format="dummy")


@pytest.mark.parametrize(("kind", "feature"), [("mistral", "sliding_window"), ("gemma2", "logit_softcap")])
def test_backend_without_the_feature_refuses_the_model(kind: str, feature: str, tokenizer, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    _build(kind, tokenizer, tmp_path)
    monkeypatch.setattr(TorchNativeBackend, "SUPPORTED_FEATURES", frozenset())
    with pytest.raises(ValueError, match=f"TorchNativeBackend does not support .*{feature}.*{ARCH_OF[kind]}"):
        _engine(tmp_path)


def test_window_covering_the_context_needs_no_window_support(tokenizer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Mistral checkpoints whose window is at least the context (v0.2+: 32k) run anywhere."""
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    _build("mistral", tokenizer, tmp_path)
    monkeypatch.setattr(TorchNativeBackend, "SUPPORTED_FEATURES", frozenset())
    engine = _engine(tmp_path, context_length=WINDOW)
    engine.shutdown()


def test_longrope_context_is_capped_at_its_original_length(tokenizer, tmp_path: Path) -> None:
    """Past original_max_position_embeddings transformers re-rotates every key with the long
    factors; we serve the exact short-factor range only."""
    from radixlm.srt.executor.model_loader import load_model

    _build("phi3", tokenizer, tmp_path)
    assert load_model(tmp_path, load_format="dummy").config.context_len == 128


# ---------------------------------------------------------------- GGUF


def _write_phi3_gguf(path: Path, model: torch.nn.Module) -> None:
    """What llama.cpp's converter writes for Phi-3: HF's fused qkv_proj and gate_up_proj as
    attn_qkv and ffn_up, unpermuted, and the window as {arch}.attention.sliding_window."""
    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_sliding_window(config.sliding_window)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_phi3_gguf_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, Phi3Config

    from radixlm.srt.executor import gguf_loader
    from radixlm.srt.executor.model_loader import load_model

    monkeypatch.setenv(gguf_loader.CACHE_DIR_ENV, str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Phi3Config(**dict(SHAPE, vocab_size=256), sliding_window=WINDOW)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    _write_phi3_gguf(tmp_path / "tiny-phi3.gguf", model)
    loaded = load_model(tmp_path / "tiny-phi3.gguf")
    model.save_pretrained(tmp_path / "hf")
    from_hf = load_model(tmp_path / "hf").config
    # Token ids live in the GGUF's tokenizer metadata; GGUF stores eps as float32.
    assert loaded.config.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    ignored = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=0.0)
    assert replace(loaded.config, **ignored) == replace(from_hf, **ignored)
    assert loaded.config.sliding_windows == (WINDOW,) * 2
    state = model.state_dict()
    assert set(loaded.weights) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded.weights[name], tensor, atol=0, rtol=0, msg=name)


def test_gemma_gguf_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm.srt.executor import gguf_loader
    from radixlm.srt.executor.model_loader import load_model

    monkeypatch.setenv(gguf_loader.CACHE_DIR_ENV, str(tmp_path / "cache"))
    path = tmp_path / "gemma.gguf"
    write_stub_gguf(path, "gemma2")
    with pytest.raises(ValueError, match="GGUF architecture 'gemma2' is not supported: .*query_pre_attn_scalar"):
        load_model(path)
