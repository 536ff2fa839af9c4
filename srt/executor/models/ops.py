"""The model's elementwise ops in two implementations with one signature: plain torch (any device,
the reference) and Triton kernels (CUDA; one launch per op instead of several)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class TorchOps:
    name = "torch"
    pdl = False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 as the reference does, then cast back.
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        residual = x + residual
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class TritonOps(TorchOps):
    """Same results as TorchOps up to reduction order; rotary works in place on q and k.
    pdl: the kernels launch with programmatic dependent launch where the GPU has it (pdl.py)."""

    name = "triton"

    def __init__(self, pdl: bool = True):
        self.pdl = pdl

    def rms_norm(self, x, weight, eps):
        from . import triton_ops

        return triton_ops.rms_norm(x, weight, eps, pdl=self.pdl)

    def add_rms_norm(self, x, residual, weight, eps):
        from . import triton_ops

        return triton_ops.add_rms_norm(x, residual, weight, eps, pdl=self.pdl)

    def silu_and_mul(self, x):
        from . import triton_ops

        return triton_ops.silu_and_mul(x, pdl=self.pdl)

    def rotary(self, positions, q, k, cos_cache, sin_cache):
        from . import triton_ops

        if _adjacent_heads(q, k):  # q and k heads side by side in the fused qkv output: one launch
            both = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
            triton_ops.rotary_inplace(positions, both, cos_cache, sin_cache, pdl=self.pdl)
        else:
            triton_ops.rotary_inplace(positions, q, cos_cache, sin_cache, pdl=self.pdl)
            triton_ops.rotary_inplace(positions, k, cos_cache, sin_cache, pdl=self.pdl)
        return q, k


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.stride() == k.stride() and q.shape[2] == k.shape[2]
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


TORCH_OPS = TorchOps()


def select_ops(device: torch.device, head_dim: int, pdl: bool = True) -> TorchOps:
    """Triton kernels on CUDA when triton imports and the head size suits them; torch otherwise."""
    if device.type != "cuda":
        return TORCH_OPS
    if head_dim & (head_dim - 1):
        logger.info("head_dim %d is not a power of two: using torch ops", head_dim)
        return TORCH_OPS
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: using torch ops on CUDA (pip install 'radixlm[gpu]')")
        return TORCH_OPS
    return TritonOps(pdl)
