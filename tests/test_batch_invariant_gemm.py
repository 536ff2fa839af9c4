"""The batch-invariant GEMM (the projections of --enable-deterministic-inference on CUDA) on CPU,
in Triton's interpreter: close to torch's product, with and without a bias, and row 0's bits the
same at every row count, whether the call runs split into K chunks (a program each, summed by a
second kernel) or walks the chunks in one program. float32, whose outputs keep the chunk sums'
rounding (fp16 outputs could round a wrong order away). The interpreter's arithmetic is not the
GPU's (test_gpu_deterministic.py checks that); the sm_90 build is in test_triton_compile.py."""

from __future__ import annotations

from triton_interpreter import run_in_interpreter

CHECK = """
import torch
from radixlm.srt.executor import batch_invariant_gemm as gemm
gemm.CHUNK_K = 128  # K = 320: chunks of 128, 128 and a short 64
torch.manual_seed(0)
x = torch.randn(200, 320)
w = torch.randn(96, 320) / 16
problems, rows = [], {}
for bias in (torch.randn(96), None):
    ref = x @ w.T + (bias if bias is not None else 0)
    for split_below, mode in ((0, "sequential"), (10 ** 6, "split")):
        gemm.SPLIT_BELOW_TILES = split_below
        for m in (1, 3, 64, 65, 200):
            assert (gemm.split_chunks(m, 96, 320) > 0) == (mode == "split")
            y = gemm.invariant_linear_cuda(x[:m], w, bias)
            if (y - ref[:m]).abs().max().item() > 1e-4:
                problems.append(("far from torch", mode, m))
            rows[(bias is None, mode, m)] = y[0]
    first = rows[(bias is None, "sequential", 1)]
    problems += [key for key, row in rows.items() if key[0] == (bias is None) and not torch.equal(row, first)]
print(problems or "ok")
"""


def test_a_row_has_the_same_bits_at_every_row_count_split_or_not():
    assert run_in_interpreter(CHECK) == "ok"
