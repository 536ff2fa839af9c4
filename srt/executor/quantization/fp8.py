"""FP8 weights (`--quantization fp8`): after a bf16/fp16/fp32 checkpoint is loaded, each linear
projection of the decoder layers (qkv, o, gate_up, down) becomes an `Fp8Linear`: e4m3 weights
with one scale per output channel, activations quantized per token at run time, and the GEMM
through `torch._scaled_mm` (cuBLAS/CUTLASS on Hopper, a reference kernel on CPU). On CUDA,
batches of up to GEMV_MAX_ROWS rows (decode) instead run fp8_gemv.py, which streams the weights
at bandwidth and leaves the activations unquantized. Larger batches get their input quantized by
the op that makes it where that op is an RMSNorm or SiLU-and-mul (forward_rms_norm,
forward_silu_and_mul; fp8_triton.py). Embeddings, the LM head, norms and MoE routers stay in
the model dtype; MoE experts are refused.

Per-channel weight scales and per-token activation scales: both are "row-wise" scales of
_scaled_mm, so one GEMM applies them (out[m, n] = acc[m, n] * sa[m] * sb[n]) with no host sync
and with shapes fixed by the batch, which CUDA graphs need. The module quantizes whatever
shape its weight has, so a tensor-parallel rank's slice quantizes the same way.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..kernel_options import KernelOptions

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The decoder layers' projections (layers.py); any other nn.Linear (router, LM head) stays.
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# FP8 tensor-core GEMMs: Ada (8.9) and Hopper (9.0) and later.
MIN_CUDA_CAPABILITY = (8, 9)
# _scaled_mm needs both dimensions of the weight to be multiples of 16.
SCALED_MM_ALIGN = 16
_EPS = 1e-12  # an all-zero row (or token) gets a tiny scale, not a division by zero


def check_fp8_device(device: torch.device, what: str = "quantization fp8") -> None:
    """Refuses a CUDA device without FP8 GEMMs (capability < 8.9), naming it."""
    if device.type != "cuda":
        return  # CPU: torch's reference _scaled_mm
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{what}: {name} (CUDA capability {capability[0]}.{capability[1]}) has no FP8 support; "
                         f"FP8 needs capability >= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} (Ada, Hopper)")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], float32 scales [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_EPS)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [M, 1]); a Triton kernel on CUDA (one launch
    instead of five), torch elsewhere."""
    if x.is_cuda and _triton_quant is not None:
        return _triton_quant(x)
    return quantize_per_token_torch(x)


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_EPS)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in e4m3 and per-output-channel scales; x quantized per token."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, options: KernelOptions = KernelOptions()):
        """options: which of our kernels it runs (fp8_gemv, fused input quantization, PDL)."""
        super().__init__()
        self.options = options
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())  # [N, K] e4m3, row-major: W^T is column-major
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1).contiguous())  # [1, N]
        self.register_buffer("bias", bias)
        self.out_dtype = out_dtype
        self._weight_values: torch.Tensor | None = None  # CPU only: see _cpu_scaled_mm
        # Row-wise scaled GEMMs on CUDA produce bf16 (the CUTLASS path accepts nothing else);
        # other model dtypes are cast after. On CPU the output is the model dtype directly.
        self.gemm_dtype = torch.bfloat16 if weight.is_cuda else out_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, options: KernelOptions = KernelOptions()) -> "Fp8Linear":
        q, scale = quantize_weight(linear.weight.data)
        bias = linear.bias.data if linear.bias is not None else None
        return cls(q, scale, bias, linear.weight.dtype, options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._uses_gemv(x2):
            # Decode-sized batches: one Triton launch that streams the weights at HBM bandwidth
            # with x unquantized (cuBLAS's FP8 GEMM reads them at a fraction of it for a few rows).
            return self._finish(_fp8_gemv(x2, self.weight, self.weight_scale, self.out_dtype, pdl=self.options.pdl),
                                lead)
        return self.forward_quantized(*quantize_per_token(x2), lead)

    def _uses_gemv(self, x2: torch.Tensor) -> bool:
        return (x2.is_cuda and self.options.fp8_gemv and _fp8_gemv is not None and x2.shape[0] <= GEMV_MAX_ROWS
                and x2.dtype in _GEMV_DTYPES)

    def forward_quantized(self, xq: torch.Tensor, x_scale: torch.Tensor, lead: torch.Size | None = None) -> torch.Tensor:
        """The GEMM on input already quantized per token: xq e4m3 [M, K], x_scale float32 [M, 1]."""
        if xq.is_cuda:
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                   out_dtype=self.gemm_dtype)
        else:
            out = self._cpu_scaled_mm(xq, x_scale)
        return self._finish(out.to(self.out_dtype), xq.shape[:-1] if lead is None else lead)

    def _fuses_quantization(self, x2: torch.Tensor) -> bool:
        """Whether the op that makes x2 may quantize it for us (fp8_triton's fused kernels): on
        CUDA at sizes that take the quantized GEMM, unless turned off for a comparison."""
        return (_fused_quant is not None and self.options.fused_fp8_quantization and x2.is_cuda
                and not self._uses_gemv(x2))

    def forward_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float) -> torch.Tensor | None:
        """self(rms_norm(x [+ residual])) with the norm writing e4m3 directly (residual += x in
        place, as triton_ops.add_rms_norm does); None where that does not apply (then the caller
        runs the norm and self)."""
        if x.dim() != 2 or not self._fuses_quantization(x):
            return None
        return self.forward_quantized(*_fused_quant.rms_norm_quant(x, residual, norm_weight, eps))

    def forward_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) with SiLU-and-mul writing e4m3 directly; None where that does not
        apply (then the caller runs the activation and self)."""
        if gate_up.dim() != 2 or gate_up.shape[1] > 2 * _MAX_FUSED_COLS or not self._fuses_quantization(gate_up):
            return None
        return self.forward_quantized(*_fused_quant.silu_and_mul_quant(gate_up))

    def _finish(self, out: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def _cpu_scaled_mm(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """What _scaled_mm computes (e4m3 products summed in fp32, then both scales), with the
        weight's e4m3 values cast to fp32 once: torch's CPU _scaled_mm converts the whole
        weight on every call (~40 ms per projection of the default model)."""
        if self._weight_values is None:
            self._weight_values = self.weight.float()  # exact: every e4m3 value is an fp32 value
        return ((xq.float() @ self._weight_values.t()) * x_scale * self.weight_scale).to(self.gemm_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this module multiplies by, in float32 (for tests and references)."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 per-channel"


def quantize_model_fp8(model: nn.Module, device: torch.device, options: KernelOptions = KernelOptions()) -> int:
    """Replaces the decoder layers' projections with Fp8Linear in place; returns how many.
    Refuses MoE experts (not quantized yet) and a device without FP8, by name."""
    check_fp8_device(device)
    from ..models.layers import is_plain_linear
    from ..models.moe import SparseMoE

    if any(isinstance(m, SparseMoE) for m in model.modules()):
        arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        raise ValueError(f"quantization: fp8 is not implemented for mixture-of-experts models ({arch}): its "
                         "experts would stay in the model dtype; run it without --quantization")
    replaced, skipped = 0, []
    for parent_name, parent in list(model.named_modules()):
        for name in LINEAR_NAMES:
            child = getattr(parent, name, None)
            if child is None:
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if not is_plain_linear(child):
                raise TypeError(f"quantization fp8: {full} is a {type(child).__name__}, not an nn.Linear; "
                                "Fp8Linear does not know what else its forward does")
            out_f, in_f = child.weight.shape
            if out_f % SCALED_MM_ALIGN or in_f % SCALED_MM_ALIGN:
                skipped.append(full)  # _scaled_mm cannot run it; stays exact in the model dtype
                continue
            setattr(parent, name, Fp8Linear.from_linear(child, options))
            replaced += 1
    if skipped:
        logger.warning("quantization fp8: %d projections kept in the model dtype (dimensions not multiples of %d), "
                       "e.g. %s", len(skipped), SCALED_MM_ALIGN, skipped[:3])
    logger.info("quantization fp8: %d projections in FP8 e4m3 (per-channel weight scales, per-token activations)",
                replaced)
    return replaced


_HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj")


def fp8_weight_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of a model whose checkpoint has these HF tensor shapes once its projections are in
    FP8: one byte per projection weight plus a float32 scale per row, the rest in `dtype`."""
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and module in _HF_LINEARS and ".experts." not in name:
            total += numel + 4 * shape[0]
        else:
            total += numel * dtype.itemsize
    return total


def _load_triton():
    try:
        from . import fp8_gemv, fp8_triton
    except ImportError:
        return None, None, None
    return fp8_triton.quantize_per_token_triton, fp8_gemv.fp8_gemv, fp8_triton


_triton_quant, _fp8_gemv, _fused_quant = _load_triton()
# SiLU-and-mul quantizes a whole row per program; wider rows keep the separate kernels.
_MAX_FUSED_COLS = 32768
# Up to this many rows fp8_gemv beats quantize + _scaled_mm on the H200
# (benchmarks/bench_gpu_fp8_gemv.py); it multiplies bf16/fp16 activations only.
GEMV_MAX_ROWS = 16
_GEMV_DTYPES = (torch.bfloat16, torch.float16)
