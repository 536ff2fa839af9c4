"""Batched LoRA in the model's projections: one base GEMM for the whole batch, then every
adapter's low-rank product at once.

Each wrapped projection holds its adapters' A matrices stacked over the device slots,
[parts * slots * rank, in], and B per part (q|k|v are three parts of qkv_proj, gate|up two of
gate_up_proj): `h = x A^T`, each token's row masked to its own adapter's slot and scaled by
alpha / r, then `out[:, part] += h_part B_part^T`. Every shape is the batch's and the slots',
so the same code serves one adapter or eight, and a CUDA graph captures it. The FLOPs of
the slots a token does not use are the price (at 8 slots of rank 16 on Llama-3.1-8B's shape, a
few percent of the base GEMMs'); on CUDA the gathered kernels of triton_lora.py read only each
token's own adapter instead. A batch with no adapter token skips all of it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from .adapter import FUSED_OF, TARGET_MODULES, AdapterConfig, parse_key

# Our fused projection -> its parts in output-row order.
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module in this (rank's) config."""
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass
class AdapterWeights:
    """One adapter's tensors on the host, in the serving dtype: (A [r, in], B [out, r]) by
    (layer, module)."""

    config: AdapterConfig
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_weights(path: str, config: AdapterConfig, model: ModelConfig, dtype: torch.dtype,
                 shard=None) -> AdapterWeights:
    """The adapter's tensors, each checked against the (whole) base model's shapes (ValueError
    naming the tensor). Under tensor parallelism (`shard`, this rank's ShardPlan) each is cut as
    its projection is: B by output rows for the column-parallel q/k/v/gate/up, A by input
    columns for the row-parallel o/down, whose partial sums then ride the layer's all-reduce."""
    from safetensors.torch import load_file

    from .adapter import WEIGHTS_FILE

    raw = load_file(f"{path}/{WEIGHTS_FILE}")
    shapes = module_shapes(model)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        parsed = parse_key(key)
        if parsed is None:
            raise ValueError(f"lora adapter {path!r}: tensor {key!r} is not a LoRA A/B matrix of "
                             f"{', '.join(TARGET_MODULES)} (embedding and LM-head LoRA are not implemented)")
        layer, module, which = parsed
        if module not in TARGET_MODULES:
            raise ValueError(f"lora adapter {path!r}: tensor {key!r}: LoRA on {module} is not implemented")
        if not 0 <= layer < model.num_layers:
            raise ValueError(f"lora adapter {path!r}: tensor {key!r}: the base model has {model.num_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (config.rank, fan_in) if which == "A" else (fan_out, config.rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"lora adapter {path!r}: tensor {key!r} has shape {tuple(tensor.shape)}, the base model "
                             f"needs {want} (an adapter of another base model?)")
        if shard is not None:
            tensor = _rank_part(tensor, shard.pieces(f"{module}.weight"), which)
        found.setdefault((layer, module), {})[which] = tensor.to(dtype)
    weights = AdapterWeights(config)
    for (layer, module), pair in found.items():
        if len(pair) != 2:
            raise ValueError(f"lora adapter {path!r}: layer {layer} {module} has lora_A or lora_B but not both")
        weights.tensors[(layer, module)] = (pair["A"], pair["B"])
    if not weights.tensors:
        raise ValueError(f"lora adapter {path!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return weights


def _rank_part(tensor: torch.Tensor, pieces, which: str) -> torch.Tensor:
    """The part of an A or B matrix a rank holds, from its projection's pieces (sharding.py):
    rows of the weight are rows of B, its columns are columns of A."""
    if pieces is None:
        return tensor
    cut = [(dim, start, stop) for dim, start, stop in pieces if (dim == 0) == (which == "B")]
    if not cut:
        return tensor
    return torch.cat([tensor.narrow(dim, start, stop - start) for dim, start, stop in cut], dim=cut[0][0]).contiguous()


class BatchAdapters:
    """Which adapter slot each token of the current forward uses, as the masks the projections
    multiply by: `mask(parts)` is [T, parts * slots * rank], a token's own slot's columns set to
    its adapter's scaling, the rest 0. None when no token uses an adapter."""

    def __init__(self, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 triton_max_tokens: int = 0, pdl: bool = True):
        """triton_max_tokens: forwards of up to this many tokens take their products from the
        gathered kernels of triton_lora.py (CUDA), larger ones (and all with 0) from the masks;
        pdl: those kernels launch with PDL (KernelOptions.pdl)."""
        self.num_slots, self.max_rank = num_slots, max_rank
        # Row s: slot s's columns at its scaling; the last row (base-model tokens) all zeros.
        self.table = torch.zeros(num_slots + 1, num_slots * max_rank, device=device, dtype=dtype)
        self.scaling = torch.zeros(num_slots, device=device, dtype=torch.float32)  # for the kernels
        self.device = device
        self.triton_max_tokens = triton_max_tokens
        self.pdl = pdl
        self.rows: torch.Tensor | None = None  # each token's table row this forward; None: no adapters
        self._masks: dict[int, torch.Tensor] = {}

    def set_scaling(self, slot: int, scaling: float, rank: int) -> None:
        row = self.table[slot]
        row.zero_()
        row[slot * self.max_rank: slot * self.max_rank + rank] = scaling
        self.scaling[slot] = scaling

    def prepare(self, token_slots: list[int]) -> None:
        """A forward whose token i uses slot token_slots[i] (-1: the base model)."""
        rows = None
        if any(s >= 0 for s in token_slots):
            rows = self.index_of(token_slots).to(self.device, non_blocking=True)
        self.prepare_from(rows)

    def index_of(self, token_slots: list[int]) -> torch.Tensor:
        """Rows of `table` for these tokens' slots (the zero row for the base model's)."""
        return torch.tensor([s if s >= 0 else self.num_slots for s in token_slots], dtype=torch.int64)

    def prepare_from(self, rows: torch.Tensor | None) -> None:
        """A forward whose tokens' table rows are in the device tensor `rows` (None: no adapter
        in it). A CUDA graph captures the forward after this call, so a replay reads whatever
        rows were copied into the tensor for it (cuda_graph_runner.py)."""
        self.rows, self._masks = rows, {}

    def mask(self, parts: int) -> torch.Tensor:
        """[T, parts * slots * rank]: each token's own slot's columns at its scaling, the rest 0
        (gathered in the forward, so that a CUDA graph replays the gather)."""
        if 1 not in self._masks:
            self._masks[1] = self.table[self.rows]
        if parts not in self._masks:
            self._masks[parts] = self._masks[1].repeat(1, parts)
        return self._masks[parts]


class LoRALinear(nn.Module):
    """A projection plus the low-rank products of the adapters in the device slots."""

    def __init__(self, base: nn.Module, parts: tuple[str, ...], shapes: dict[str, tuple[int, int]],
                 batch: BatchAdapters):
        super().__init__()
        self.base = base
        self.parts = parts
        self.batch = batch
        slots, rank = batch.num_slots, batch.max_rank
        fan_in = shapes[parts[0]][0]
        weight = base.weight
        kw = {"device": weight.device, "dtype": batch.table.dtype}
        # A of every part, stacked: rows [p * slots * rank + s * rank, ... + rank) are part p, slot s.
        self.register_buffer("lora_a", torch.zeros(len(parts) * slots * rank, fan_in, **kw), persistent=False)
        offsets, start = [], 0
        for p in parts:
            offsets.append((start, start + shapes[p][1]))
            start += shapes[p][1]
        self.offsets = offsets
        # B of every part stacked by output rows, [out, slots * rank]; self._b: each part's rows.
        self.register_buffer("lora_b", torch.zeros(start, slots * rank, **kw), persistent=False)
        self._b: list[torch.Tensor] = [self.lora_b[a:b] for a, b in offsets]

    @property
    def weight(self) -> torch.Tensor:  # code that reads a projection's weight sees the base one
        return self.base.weight

    def write_slot(self, slot: int, part_weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these parts' (A, B) (ranks below the slot's padded with zeros);
        a part without weights is zero."""
        rank = self.batch.max_rank
        width = self.batch.num_slots * rank
        for i, part in enumerate(self.parts):
            rows = self.lora_a[i * width + slot * rank: i * width + (slot + 1) * rank]
            cols = self._b[i][:, slot * rank:(slot + 1) * rank]
            rows.zero_()
            cols.zero_()
            if part in part_weights:
                a, b = part_weights[part]
                rows[:a.shape[0]].copy_(a, non_blocking=True)
                cols[:, :b.shape[1]].copy_(b, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.rows is None:
            return out
        if x.shape[0] <= batch.triton_max_tokens:
            from .triton_lora import lora_shrink_expand

            return lora_shrink_expand(x, out, self.lora_a, self.lora_b, self.offsets, batch.rows, batch.scaling,
                                      batch.num_slots, batch.max_rank, batch.pdl)
        h = F.linear(x, self.lora_a) * batch.mask(len(self.parts))
        width = self.batch.num_slots * self.batch.max_rank
        if len(self.parts) == 1:
            return out.addmm_(h, self._b[0].t())
        for i, (start, stop) in enumerate(self.offsets):
            out[:, start:stop].addmm_(h[:, i * width:(i + 1) * width], self._b[i].t())
        return out


class LoRASlots:
    """The adapters of one rank: their tensors in host memory (by the engine's handle for each),
    the device slots, every target projection wrapped. `prepare` runs before each forward: the
    slot loads the step needs, then each token's slot."""

    def __init__(self, model: nn.Module, full_config: ModelConfig, num_slots: int, max_rank: int,
                 targets: tuple[str, ...], device: torch.device, dtype: torch.dtype, shard=None,
                 triton_max_tokens: int = 0, pdl: bool = True):
        """full_config: the whole model's (an adapter's tensors are checked against it); the
        model holds this rank's part of it (`shard`, under tensor parallelism).
        triton_max_tokens, pdl: see BatchAdapters."""
        self.batch = BatchAdapters(num_slots, max_rank, device, dtype, triton_max_tokens, pdl)
        self.full_config, self.dtype, self.shard = full_config, dtype, shard
        self.host: dict[int, AdapterWeights] = {}
        shapes = module_shapes(model.config)
        self.layers: list[dict[str, LoRALinear]] = []
        fused_targets = {FUSED_OF[t] for t in targets}
        for layer in model.layers:
            wrapped = {}
            for fused, parent in (("qkv_proj", layer.self_attn), ("o_proj", layer.self_attn),
                                  ("gate_up_proj", layer.mlp), ("down_proj", layer.mlp)):
                if fused not in fused_targets:
                    continue
                lora = LoRALinear(getattr(parent, fused), PARTS[fused], shapes, self.batch)
                setattr(parent, fused, lora)
                wrapped[fused] = lora
            self.layers.append(wrapped)

    def add(self, handle: int, path: str, config: AdapterConfig | None = None) -> None:
        """Reads an adapter into host memory (ValueError naming what does not fit the model)."""
        if handle not in self.host:
            from .adapter import read_config

            config = config or read_config(path)
            self.host[handle] = read_weights(path, config, self.full_config, self.dtype, self.shard)

    def drop(self, handle: int) -> None:
        self.host.pop(handle, None)

    def prepare(self, loads, drops, token_slots: list[int] | None) -> None:
        """loads: (slot, handle, path) copies to run first (a rank reads a path it has not yet);
        drops: handles unloaded; token_slots: each token's slot (-1: the base model)."""
        for handle in drops:
            self.drop(handle)
        for slot, handle, path in loads:
            self.add(handle, path)
            self._load(slot, self.host[handle])
        self.batch.prepare(token_slots or [])

    def _load(self, slot: int, weights: AdapterWeights) -> None:
        for layer_id, wrapped in enumerate(self.layers):
            for fused, lora in wrapped.items():
                lora.write_slot(slot, {part: weights.tensors[(layer_id, part)] for part in PARTS[fused]
                                       if (layer_id, part) in weights.tensors})
        cfg = weights.config
        self.batch.set_scaling(slot, cfg.scaling, cfg.rank)


def lora_bytes(config: ModelConfig, num_slots: int, max_rank: int, targets: tuple[str, ...], dtype: torch.dtype) -> int:
    """Device memory the slots take (the KV pool is sized after it)."""
    shapes = module_shapes(config)
    per_layer = sum(shapes[t][0] + shapes[t][1] for t in targets) * num_slots * max_rank
    return per_layer * config.num_layers * torch.finfo(dtype).bits // 8


# --lora-backend auto on CUDA: the gathered kernels for forwards of up to this many tokens, the
# masked products (cuBLAS) above: on an H100 the kernels won at 1 token and lost at 64
# (benchmarks/results/gpu_h100_lora_kernel.jsonl, docs/lora.md).
AUTO_TRITON_MAX_TOKENS = 8


def triton_max_tokens(args) -> int:
    """--lora-backend: triton always takes the gathered kernels, torch never, auto on CUDA for
    forwards of up to AUTO_TRITON_MAX_TOKENS tokens (decode of small batches)."""
    backend = args.lora.lora_backend
    if backend == "triton":
        return sys.maxsize
    if backend == "auto" and args.model.resolved_device().startswith("cuda"):
        return AUTO_TRITON_MAX_TOKENS
    return 0


def check_lora_supported(args, config: ModelConfig) -> None:
    """Refuses, by name, what LoRA serving does not do yet."""
    if args.lora.lora_backend == "triton" and args.model.resolved_device() == "cpu":
        raise ValueError("lora_backend: triton needs a CUDA device (torch runs LoRA on CPU)")
    if args.executor.enable_deterministic_inference:
        raise ValueError("enable_lora: with --enable-deterministic-inference is not implemented yet")
    if config.sparse_layers:
        raise ValueError(f"enable_lora: LoRA on a mixture-of-experts model ({config.architecture}) is not implemented")
    if config.architecture.startswith("Phi3"):
        raise ValueError(f"enable_lora: LoRA on {config.architecture} (fused qkv_proj / gate_up_proj checkpoints) "
                         "is not implemented")
