"""The batch-invariant GEMM (the projections of --enable-deterministic-inference on CUDA) on CPU,
in Triton's interpreter: close to torch's product, with and without a bias, and row 0's bits the
same at every row count, as the tile follows the row count (narrow tiles for few rows, wide for
many). float32, whose outputs keep every rounding. The interpreter's dot is NumPy's product of
a whole K step, so the tiles here share one K step (on the GPU the step does not matter either:
tests/test_gpu_deterministic.py checks the bits there); the sm_90 build is in
test_triton_compile.py."""

from __future__ import annotations

from triton_interpreter import ROW_BY_ROW_DOT, run_in_interpreter

CHECK = """
import torch
from radixlm.srt.executor import batch_invariant_gemm as gemm
Tiles = gemm.Tiles
gemm.NARROW = (Tiles(64, 16, 64, 4, 4), Tiles(64, 32, 64, 4, 4), Tiles(64, 128, 64, 4, 4))
gemm.WIDE = Tiles(128, 64, 64, 8, 3)
gemm.WIDE_FROM_ROWS = 65
torch.manual_seed(0)
x = torch.randn(200, 320)  # K = 320: five steps of 64
w = torch.randn(96, 320) / 16
problems, rows, used = [], {}, set()
for bias in (torch.randn(96), None):
    ref = x @ w.T + (bias if bias is not None else 0)
    for m in (1, 3, 64, 65, 200):
        for sms in (1, 2, 8, 64):  # which tile gives every SM its programs
            used.add(gemm.tiles_for(m, 96, sms))
            y = gemm.invariant_linear_cuda(x[:m], w, bias, gemm.tiles_for(m, 96, sms))
            if (y - ref[:m]).abs().max().item() > 1e-4:
                problems.append(("far from torch", m, sms))
            rows[(bias is None, m, sms)] = y[0]
    first = rows[(bias is None, 1, 1)]
    problems += [key for key, row in rows.items() if key[0] == (bias is None) and not torch.equal(row, first)]
if len(used) < 3:
    problems.append(("tiles used", used))
print(problems or "ok")
"""


def test_a_row_has_the_same_bits_at_every_row_count_whatever_its_tile():
    assert run_in_interpreter(ROW_BY_ROW_DOT + CHECK) == "ok"
