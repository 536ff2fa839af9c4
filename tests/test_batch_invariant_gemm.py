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


def _linear(x, w, b):
    return x @ w.T + (b if b is not None else 0)


def _counted_products():
    """(call counts, fast, reference): a stand-in fast product that differs from the reference
    at 128 padded rows (as a split-K kernel would), but not on zeros."""
    calls = {"fast": 0, "reference": 0}

    def fast(x, w, b):
        calls["fast"] += 1
        y = _linear(x, w, b)
        return y + 1e-3 * y.sign() if x.shape[0] == 128 else y  # zero where x is zero

    def reference(x, w, b):
        calls["reference"] += 1
        return _linear(x, w, b)

    return calls, fast, reference


def test_a_faster_product_is_used_only_for_shapes_where_it_gives_the_same_bits():
    """cuBLAS stands in for the Triton kernel only at shapes where it matched it on a random
    probe. Here the fast product differs (as a split-K kernel would) at 128 padded rows, but not
    on zeros: a call of zeros there must not prove it, and keeps the reference's bits."""
    import torch

    from radixlm.srt.executor.batch_invariant_gemm import ProvenFastPath

    calls, fast, reference = _counted_products()
    path = ProvenFastPath(fast, reference, min_rows=64, row_bucket=64)
    torch.manual_seed(0)
    x, w = torch.randn(200, 32), torch.randn(48, 32)
    assert path.run(x[:10], w, None) is None  # too few rows: the caller runs the reference
    assert path.run(torch.zeros(100, 32), w, None) is None  # 128 padded rows: disproven on the probe
    assert path.run(x[:70], w, None) is None  # the same key: not tried again
    for m in (64, 64, 150):
        y = path.run(x[:m], w, None)
        assert y.shape == (m, 48) and torch.equal(y, reference(x[:m], w, None)), m
    assert path.same_bits == {(128, 48, 32, torch.float32, torch.float32, None, None): False,
                              (64, 48, 32, torch.float32, torch.float32, None, None, 32, x.data_ptr() % 256 // 4): True,
                              (192, 48, 32, torch.float32, torch.float32, None, None): True}
    calls.update(fast=0, reference=0)
    path.run(x[:64], w, None), path.run(x[:150], w, None), path.run(x[:120], w, None)
    assert calls == {"fast": 2, "reference": 0}  # proven shapes run the fast product alone; None for 128


def test_row_buckets_proven_ahead_serve_their_first_call_from_the_fast_product():
    """What the engine proves before capturing CUDA graphs: a bucket proven ahead answers both a
    padded call and an exact one of a contiguous input; a bucket whose proof failed never runs
    the fast product; one proof stands for every weight of the same shape."""
    import torch

    from radixlm.srt.executor.batch_invariant_gemm import ProvenFastPath

    calls, fast, reference = _counted_products()
    path = ProvenFastPath(fast, reference, min_rows=64, row_bucket=64)
    torch.manual_seed(0)
    w, other = torch.randn(48, 32), torch.randn(48, 32)
    for rows in (64, 128, 192):
        path.prove_rows(rows, w, None, torch.float32)
        path.prove_rows(rows, other, None, torch.float32)  # the same shape: already proven
    assert calls == {"fast": 3, "reference": 3}
    path.settle()  # nothing pending on CPU
    assert sorted(path.same_bits.values()) == [False, False, True, True, True, True]
    key = (192, 48, 32, torch.float32, torch.float32, None, None)
    assert path.same_bits[key] is True and path.same_bits[key + (32, 0)] is True  # padded, and exact
    calls.update(fast=0, reference=0)
    x = torch.randn(150, 32)
    assert path.run(x[:70], other, None) is None  # 128 rows: disproven, the caller runs the reference
    y = path.run(x, other, None)  # 192 rows: proven ahead, the fast product at once
    assert calls == {"fast": 1, "reference": 0}
    assert torch.equal(y, reference(x, other, None))
