"""Hugging Face checkpoint names: the tensors a family's checkpoint holds, and where each lands in
our fused parameters (q|k|v rows, gate|up rows, experts stacked along a leading axis)."""

from __future__ import annotations

import re

import torch

from ...configs import ModelConfig
from .family import Family

_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


def hf_weight_shapes(config: ModelConfig, family: Family) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a checkpoint of this family and config."""
    hidden, head_dim, vocab = config.hidden_size, config.head_dim, config.vocab_size
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        shapes.update({prefix + f"{norm}.weight": (hidden,) for norm in norms})
        attn = prefix + "self_attn."
        if family.fused_qkv_checkpoint:
            shapes[attn + "qkv_proj.weight"] = (q_rows + 2 * kv_rows, hidden)
        else:
            shapes.update({attn + "q_proj.weight": (q_rows, hidden), attn + "k_proj.weight": (kv_rows, hidden),
                           attn + "v_proj.weight": (kv_rows, hidden)})
        if config.attention_bias:
            shapes.update({attn + "q_proj.bias": (q_rows,), attn + "k_proj.bias": (kv_rows,),
                           attn + "v_proj.bias": (kv_rows,)})
        shapes[attn + "o_proj.weight"] = (hidden, q_rows)
        if config.o_proj_bias:
            shapes[attn + "o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes.update({attn + "q_norm.weight": (head_dim,), attn + "k_norm.weight": (head_dim,)})
        mlp = prefix + family.mlp_name + "."
        if layer in config.sparse_layers:
            inter = config.moe_intermediate_size
            shapes[mlp + "gate.weight"] = (config.num_experts, hidden)
            gate, up, down = family.expert_names
            for e in range(config.num_experts):
                shapes.update({f"{mlp}experts.{e}.{gate}.weight": (inter, hidden),
                               f"{mlp}experts.{e}.{up}.weight": (inter, hidden),
                               f"{mlp}experts.{e}.{down}.weight": (hidden, inter)})
        else:
            inter = config.intermediate_size
            if family.fused_gate_up_checkpoint:
                shapes[mlp + "gate_up_proj.weight"] = (2 * inter, hidden)
            else:
                shapes.update({mlp + "gate_proj.weight": (inter, hidden), mlp + "up_proj.weight": (inter, hidden)})
            shapes[mlp + "down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _target(name: str, config: ModelConfig, family: Family) -> tuple[str, tuple]:
    """(our parameter name, index into it) for a checkpoint tensor name without "model."."""
    match = _LAYER_RE.fullmatch(name)
    if match is None:
        return name, ()
    layer, rest = match.groups()
    prefix = f"layers.{layer}."
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    module, _, kind = rest.rpartition(".")
    qkv_rows = {"self_attn.q_proj": slice(0, q), "self_attn.k_proj": slice(q, q + kv),
                "self_attn.v_proj": slice(q + kv, q + 2 * kv)}
    if module in qkv_rows:
        return prefix + "self_attn.qkv_proj." + kind, (qkv_rows[module],)
    if not rest.startswith(family.mlp_name + "."):
        return prefix + rest, ()
    rest = rest[len(family.mlp_name) + 1:]
    expert = _EXPERT_RE.fullmatch(rest)
    if expert is not None:
        index, part = int(expert.group(1)), expert.group(2)
        inter = config.moe_intermediate_size
        gate, up, down = family.expert_names
        if part == gate:
            return prefix + "mlp.w13", (index, slice(0, inter))
        if part == up:
            return prefix + "mlp.w13", (index, slice(inter, 2 * inter))
        if part == down:
            return prefix + "mlp.w2", (index,)
        return prefix + "mlp." + rest, ()  # unknown: reported as unexpected
    inter = config.intermediate_size
    if rest == "gate_proj.weight":
        return prefix + "mlp.gate_up_proj.weight", (slice(0, inter),)
    if rest == "up_proj.weight":
        return prefix + "mlp.gate_up_proj.weight", (slice(inter, 2 * inter),)
    return prefix + "mlp." + rest, ()


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copies every checkpoint tensor into its slice of a decoder.CausalLM (its parameters, its
    config and family, whether it has an lm_head); each parameter must be covered exactly."""
    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    for hf_name, tensor in weights.items():
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and model.lm_head is None):
            continue  # recomputed / tied to the embedding
        target, index = _target(name, model.config, model.family)
        if target not in params:
            raise ValueError(f"unexpected weight {hf_name!r}")
        dest = params[target][index] if index else params[target]
        if target in _VOCAB_PARAMS and tensor.shape[0] < dest.shape[0]:
            # A rank's vocabulary block past the end of the vocabulary: padding rows of zeros.
            dest[tensor.shape[0]:].zero_()
            written[target] += (dest.shape[0] - tensor.shape[0]) * dest.shape[1]
            dest = dest[:tensor.shape[0]]
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        written[target] += tensor.numel()
    missing = sorted(name for name, count in written.items() if count != params[name].numel())
    if missing:
        raise ValueError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
