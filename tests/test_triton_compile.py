"""Every Triton kernel of the runtime compiles for Hopper (sm_90), here without a GPU.

The CPU interpreter (TRITON_INTERPRET=1, used by the numeric tests) runs kernels as Python and
lets through what the compiler refuses, e.g. a module-level global that is not a tl.constexpr;
such a kernel then fails only on the GPU machine, whose time is scarce. Triton compiles to PTX
and a cubin without a device, so this catches those errors in CI, and checks that the kernels
launched with programmatic dependent launch (srt/executor/pdl.py) really carry its two
instructions.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from radixlm.srt.executor import batch_invariant_gemm  # noqa: E402
from radixlm.srt.executor.attention import triton_decode  # noqa: E402
from radixlm.srt.executor.models import moe_triton, triton_ops  # noqa: E402
from radixlm.srt.executor.quantization import fp8_gemv, fp8_triton  # noqa: E402
from radixlm.srt.lora import triton_lora  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"eps", "qk_scale", "v_scale", "inv_k_scale", "inv_v_scale"}

FP8_DECODE_POINTERS = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "indptr_ptr": "*i32", "indices_ptr": "*i32",
                       "last_len_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}

# (kernel, pointer dtypes other than *bf16, constexprs, num_warps)
CASES = [
    (triton_ops._rmsnorm_kernel, {}, {"HAS_RESIDUAL": True, "BLOCK": 4096, "PDL": True}, 4),
    (triton_ops._rmsnorm_kernel, {}, {"HAS_RESIDUAL": False, "BLOCK": 4096, "PDL": True}, 4),
    (triton_ops._silu_and_mul_kernel, {}, {"BLOCK": 1024, "PDL": True}, 4),
    (triton_ops._rotary_kernel, {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
     {"HALF": 64, "BLOCK_H": 16, "PDL": True}, 4),
    (triton_ops._store_kv_kernel, {"slot_ptr": "*i64"}, {"HEAD_DIM": 128, "PDL": True}, 4),
    (triton_ops._rotary_store_kv_kernel, {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"},
     {"GROUP": 4, "BLOCK_G": 4, "HALF": 64, "FP8": False, "FP8_MAX": 448.0, "PDL": True}, 4),
    (triton_ops._rotary_store_kv_kernel, {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64",
                                          "k_buf_ptr": "*fp8e4nv", "v_buf_ptr": "*fp8e4nv"},
     {"GROUP": 7, "BLOCK_G": 8, "HALF": 64, "FP8": True, "FP8_MAX": 448.0, "PDL": True}, 4),
    (fp8_gemv._fp8_gemv_row_kernel, {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "part_ptr": "*fp32"},
     {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "EVEN": True, "PDL": True}, 4),
    (fp8_gemv._fp8_gemv_row_kernel, {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "part_ptr": "*fp32"},
     {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 2, "EVEN": False, "PDL": True}, 4),
    (fp8_gemv._fp8_gemv_kernel, {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "part_ptr": "*fp32"},
     {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "EVEN": False, "PDL": True}, 4),
    (fp8_gemv._sum_splits_kernel, {"part_ptr": "*fp32", "scale_ptr": "*fp32"},
     {"SPLIT_K": 4, "BLOCK": 1024, "PDL": True}, 4),
    (fp8_triton._quant_rows_kernel, {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
     {"FP8_MAX": 448.0, "EPS": 1e-12, "BLOCK": 4096}, 8),
    (fp8_triton._rmsnorm_quant_kernel, {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
     {"HAS_RESIDUAL": True, "FP8_MAX": 448.0, "EPS": 1e-12, "BLOCK": 4096}, 4),
    (fp8_triton._silu_and_mul_quant_kernel, {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
     {"FP8_MAX": 448.0, "EPS": 1e-12, "BLOCK": 16384}, 16),
    (fp8_triton._store_kv_fp8_kernel, {"slot_ptr": "*i64", "k_buf_ptr": "*fp8e4nv", "v_buf_ptr": "*fp8e4nv"},
     {"FP8_MAX": 448.0, "HEAD_DIM": 128, "PDL": True}, 4),
    (triton_decode._decode_kernel, FP8_DECODE_POINTERS,
     {"WIDEN_FP16": True, "NUM_Q_HEADS": 32, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 1,
      "BLOCK_T": 32, "NUM_SPLITS": 16, "V_PAIRS": False, "PTX": True, "PDL": True}, 4),
    (triton_decode._decode_kernel, FP8_DECODE_POINTERS,
     {"WIDEN_FP16": True, "NUM_Q_HEADS": 32, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 1,
      "BLOCK_T": 128, "NUM_SPLITS": 1, "V_PAIRS": True, "PTX": True, "PDL": True}, 4),
    (triton_decode._decode_kernel, {"indptr_ptr": "*i32", "indices_ptr": "*i32", "last_len_ptr": "*i32",
                                    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
     {"WIDEN_FP16": False, "NUM_Q_HEADS": 32, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 16,
      "BLOCK_T": 64, "NUM_SPLITS": 1, "V_PAIRS": False, "PTX": True, "PDL": True}, 4),
    (triton_decode._merge_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
     {"NUM_Q_HEADS": 32, "HEAD_DIM": 128, "NUM_SPLITS": 16, "PDL": True}, 4),
    (batch_invariant_gemm._gemm_kernel, {},
     {"HAS_BIAS": True, "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 256, "GROUP_M": 8, "EVEN_K": False}, 4),
    (batch_invariant_gemm._gemm_kernel, {},
     {"HAS_BIAS": False, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "EVEN_K": True}, 8),
    (moe_triton._grouped_gemm_kernel, {"pair_ptr": "*i32", "expert_ptr": "*i32", "weight_ptr": "*fp32"},
     {"A_ROW_DIV": 2, "MUL_WEIGHT": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4),
    (triton_lora._shrink_kernel, {"rows_ptr": "*i64", "scaling_ptr": "*fp32", "h_ptr": "*fp32"},
     {"NUM_SLOTS": 8, "RANK": 16, "RANK_P2": 16, "BLOCK_K": 512, "PDL": True}, 4),
    (triton_lora._expand_kernel, {"h_ptr": "*fp32", "rows_ptr": "*i64"},
     {"NUM_PARTS": 3, "SPLITS": 28, "SPLITS_P2": 32, "ALIGNED": True, "NUM_SLOTS": 8, "RANK": 16, "RANK_P2": 16,
      "BLOCK_N": 64, "PDL": True}, 4),
    (triton_lora._expand_kernel, {"h_ptr": "*fp32", "rows_ptr": "*i64"},
     {"NUM_PARTS": 3, "SPLITS": 3, "SPLITS_P2": 4, "ALIGNED": False, "NUM_SLOTS": 8, "RANK": 16, "RANK_P2": 16,
      "BLOCK_N": 64, "PDL": True}, 4),
]


def _signature(kernel, pointers: dict[str, str]) -> dict[str, str]:
    """Every argument's type: constexprs as such, *_ptr as pointers (bf16 unless named), the
    float scalars as fp32, the rest (sizes, strides) as i32."""
    sig = {}
    for param in kernel.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            sig[param.name] = pointers.get(param.name, "*bf16")
        else:
            sig[param.name] = "fp32" if param.name in FLOAT_ARGS else "i32"
    unknown = set(pointers) - set(sig)
    assert not unknown, f"{kernel.__name__} has no arguments {unknown}"
    return sig


def _launch_hints(kernel) -> dict:
    """The divisibility a launch gives Triton: torch's allocations are 16-byte aligned and the
    strides here are multiples of 16, and without these hints Triton compiles other code (byte
    loads instead of vector ones)."""
    return {(i,): [["tt.divisibility", 16]] for i, param in enumerate(kernel.params)
            if not param.is_constexpr and (param.name.endswith("_ptr") or param.name.startswith("stride"))}


def _compile(kernel, pointers: dict[str, str], constexprs: dict, warps: int, stages: int = 3):
    return triton.compile(ASTSource(kernel, _signature(kernel, pointers), constexprs, _launch_hints(kernel)),
                          target=HOPPER, options={"num_warps": warps, "num_stages": stages,
                                                  "launch_pdl": constexprs.get("PDL", False)})


@pytest.mark.parametrize("kernel, pointers, constexprs, warps", CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_kernel_compiles_for_hopper(kernel, pointers, constexprs, warps):
    pdl = constexprs.get("PDL", False)
    compiled = _compile(kernel, pointers, constexprs, warps)
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]
    assert ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx) == pdl


def test_fp8_decode_reads_v_pairs_without_byte_wise_shared_loads():
    """Over an FP8 pool the decode kernel reads V as 16-bit pairs so that it is copied 16 bytes at
    a time and transposed by ldmatrix; read as bytes it was gathered from shared memory one byte
    at a time (triton_decode.paged_decode), which held long contexts at ~3.2 TB/s on the H200."""
    tiles = triton_decode.decode_tiles(torch.float8_e4m3fn, 256)
    assert tiles.v_pairs
    constexprs = {"WIDEN_FP16": True, "NUM_Q_HEADS": 32, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 1,
                  "BLOCK_T": tiles.block_t, "NUM_SPLITS": 1, "V_PAIRS": True, "PTX": True, "PDL": True}
    ptx = _compile(triton_decode._decode_kernel, FP8_DECODE_POINTERS, constexprs, tiles.num_warps,
                   tiles.num_stages).asm["ptx"]
    assert "ld.shared.b8" not in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx
    # each pair of words is widened by one byte permute and one cvt (_e4m3_pair_half_to_fp16)
    assert "prmt.b32 t, " in ptx and "cvt.rn.f16x2.e4m3x2 " in ptx


def test_every_kernel_is_covered():
    """A new kernel in these modules gets a case above."""
    covered = {case[0] for case in CASES}
    for module in (triton_ops, fp8_gemv, fp8_triton, triton_decode, moe_triton, triton_lora):
        for name in dir(module):
            value = getattr(module, name)
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                assert value in covered, f"{module.__name__}.{name} has no compile case"
