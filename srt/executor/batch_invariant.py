"""Projections whose every row comes out the same whatever else is in the batch
(--enable-deterministic-inference).

A GEMM sums each output over K in an order the library picks from the matrix shapes. On CPU,
oneDNN's linear over a weight packed once gives a row the same bits at every row count but 1,
so every projection and the LM head run through cpu_linear.PackedLinear (whatever the dtype)
with a single row padded to 2. MKL's sgemm (F.linear) varies below 4 rows per thread, so the
attention's batched products, which run through it, pad to 4 (pad_rows). The measurements, and
the MKL-only variant that made decode slower, are in docs/deterministic.md.
On CUDA the projections run in our own Triton GEMM, which never splits K, or in cuBLAS at the
shapes where cuBLAS was seen to give that kernel's bits (batch_invariant_gemm.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_linear import onednn_available, pack_projections
from .models.layers import is_plain_linear
from .models.moe import SparseMoE

ROW_MULTIPLE = 4  # MKL's products: rows padded to a multiple of this (attention/deterministic.py)
MIN_ROWS = 2  # oneDNN's packed linear (cpu_linear.py): a single row padded to this


def pad_rows(x: torch.Tensor, dim: int = 0, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """`x` with zero rows appended along `dim` up to a multiple of `multiple`."""
    pad = -x.shape[dim] % multiple
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def check_deterministic_settings(args) -> None:
    """Refuses, by name, what would make a request's answer depend on its batch again: the
    tensor-parallel all-reduce (its algorithm, and so its order, follows the message size) and
    speculative decoding (drafts, and with sampling the accepted tokens, follow the batch)."""
    name = "enable_deterministic_inference"
    if args.parallel.tp_size > 1:
        raise ValueError(f"{name}: not implemented with tp_size {args.parallel.tp_size} (the all-reduce's "
                         "summation order follows the batch)")
    if args.speculative.speculative_algorithm is not None:
        raise ValueError(f"{name}: not implemented with speculative_algorithm "
                         f"{args.speculative.speculative_algorithm}")


class CudaLinear:
    """x @ weight^T (+ bias) in the batch-invariant Triton GEMM; any leading axes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from .batch_invariant_gemm import invariant_linear_cuda

        lead = x.shape[:-1]
        out = invariant_linear_cuda(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.view(*lead, self.weight.shape[0])


class InvariantLinear(nn.Module):
    """A loaded projection on CUDA (its weight and bias, shared) computed batch-invariantly."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.product = CudaLinear(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def make_batch_invariant(model: nn.Module, device: torch.device) -> int:
    """Makes every projection of a loaded model batch-invariant, the LM head included; returns
    how many were replaced. Raises ValueError naming what cannot be: a device or build without
    the kernels, layers that are not plain projections (FP8, mixture-of-experts)."""
    name = "enable_deterministic_inference"
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: not implemented on {device.type} (CPU and CUDA are)")
    if device.type == "cpu" and not onednn_available():
        raise ValueError(f"{name}: needs a torch build with oneDNN (mkldnn) on CPU")
    if any(p.element_size() == 1 for p in model.parameters()):
        raise ValueError(f"{name}: FP8 weights are not batch-invariant yet")
    for module_name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            raise ValueError(f"{name}: mixture-of-experts layers ({module_name}) are not batch-invariant yet")
        if isinstance(module, nn.Linear) and not is_plain_linear(module):
            raise ValueError(f"{name}: {module_name} ({type(module).__name__}) has no batch-invariant version")
    if device.type == "cpu":
        return pack_projections(model, min_rows=MIN_ROWS, dtypes=None)
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if is_plain_linear(child):
                setattr(parent, child_name, InvariantLinear(child))
                replaced += 1
    model.head_linear = InvariantHead(model.lm_head_weight)
    return replaced


class InvariantHead:
    """The LM head's product (the model's `head_linear(x, weight)`) computed batch-invariantly;
    `weight` is the one it holds."""

    def __init__(self, weight: torch.Tensor):
        self.product = CudaLinear(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def prove_fast_products(model: nn.Module, dtype: torch.dtype, max_rows: int, max_head_rows: int) -> dict[str, int]:
    """Proves cuBLAS (batch_invariant_gemm.CUBLAS) at every row bucket a step can reach, and
    waits for the verdicts: each projection up to max_rows rows (a prefill step's tokens), the
    LM head up to max_head_rows (a decode step's requests). Run before CUDA graphs are captured:
    a shape first met while capturing cannot be proven and stays in the Triton kernel, and a
    shape first met while serving runs there until its proof comes back. Returns how many
    shapes were proven and how many of them run in cuBLAS."""
    from .batch_invariant_gemm import CUBLAS

    # A proof's key holds the shapes and dtypes, not the weight: one product per shape stands for all.
    products = list({(m.weight.shape, m.weight.dtype, m.bias is None): m.product
                     for m in model.modules() if isinstance(m, InvariantLinear)}.values())
    head = getattr(model, "head_linear", None)
    bucket = CUBLAS.row_bucket
    heads = [head.product] if isinstance(head, InvariantHead) else []
    for limit, group in ((max_rows, products), (max_head_rows, heads)):
        for rows in range(max(CUBLAS.min_rows, bucket), limit + bucket, bucket):
            for product in group:
                CUBLAS.prove_rows(rows, product.weight, product.bias, dtype)
    CUBLAS.settle()
    verdicts = list(CUBLAS.same_bits.values())
    return {"shapes": len(verdicts), "fast": sum(v is True for v in verdicts)}
