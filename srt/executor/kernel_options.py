"""Which of our kernel paths a device engine runs. Each is on by default; a setting turns
one off (`--disable-pdl`, ...) to measure what it gains in the same run, or to rule it out when
chasing a bug. Carried by the objects that launch the kernels (ops, KV pool, FP8 projections,
attention backend), never by module state: two engines in one process may differ."""

from __future__ import annotations

from dataclasses import dataclass

from ..server_args import ExecutorSettings


@dataclass(frozen=True)
class KernelOptions:
    pdl: bool = True  # programmatic dependent launch between our Triton kernels (Hopper and later; pdl.py)
    fp8_gemv: bool = True  # decode-sized FP8 projections through fp8_gemv.py, not quantize + _scaled_mm
    fused_fp8_quantization: bool = True  # norms and SiLU-and-mul write the next FP8 GEMM's input
    fused_rotary_store: bool = True  # the rotation and the KV store in one launch (FlashInfer backend)
    onednn_linear: bool = True  # CPU float32 projections through oneDNN over packed weights (cpu_linear.py)

    @classmethod
    def from_settings(cls, executor: ExecutorSettings) -> KernelOptions:
        return cls(pdl=not executor.disable_pdl, fp8_gemv=not executor.disable_fp8_gemv,
                   fused_fp8_quantization=not executor.disable_fused_fp8_quantization,
                   fused_rotary_store=not executor.disable_fused_rotary_store,
                   onednn_linear=not executor.disable_onednn_linear)
