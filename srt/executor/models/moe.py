"""Mixture-of-experts block: a router picks top-k experts per token, each a gated MLP.

The experts' weights are stacked ([E, 2I, H] for gate|up, [E, H, I] for down) so a kernel can
run them all as one grouped GEMM over tokens sorted by expert; checkpoints' per-expert tensors
are copied into their slices when loading. `expert_forward` is the torch reference (any
device); on CUDA the fused Triton kernel in moe_triton.py runs instead when it imports.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..parallel import TensorParallel
from .layers import SINGLE, Linear, act_and_mul
from .ops import TORCH_OPS, TorchOps

logger = logging.getLogger(__name__)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts in fp32, then the
    top k; renormalised to sum to one when `renormalize` (Mixtral always, Qwen3-MoE with
    norm_topk_prob). This is the order of operations transformers uses for both families."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """Torch reference: sum over each token's k experts of weight * down(act(gate) * up).

    Token-expert pairs are sorted by expert so each expert runs one matmul over its tokens.
    Reads the per-expert counts on the host: fine on CPU, a sync on GPU (the kernel avoids it).
    """
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        h = act_and_mul(x[tokens] @ w13[expert].t(), hidden_act) @ w2[expert].t()
        # transformers scales in fp32 (the weights' dtype) and adds in the model's dtype.
        out.index_add_(0, tokens, (h * flat_weights[pairs, None]).to(x.dtype))
    return out


class SparseMoE(nn.Module):
    """Router (`gate`, no bias) and stacked experts; output = sum_k w_k * expert_k(x). Under
    tensor parallelism every rank routes alike and holds each expert's share of the
    intermediate columns; the partial outputs are added over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 hidden_act: str = "silu", ops: TorchOps = TORCH_OPS, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.hidden_act = hidden_act
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.use_triton = ops.name == "triton" and hidden_act == "silu"
        self.pdl = ops.pdl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.use_triton and x.is_cuda:
            from .moe_triton import fused_moe

            return self.tp.all_reduce(fused_moe(x, self.w13, self.w2, weights, ids, pdl=self.pdl))
        return self.tp.all_reduce(expert_forward(x, self.w13, self.w2, weights, ids, self.hidden_act))
