"""A batch-invariant GEMM for CUDA (--enable-deterministic-inference): y = x @ w^T (+ b).

cuBLAS picks its kernel, tile and split-K from the matrix shapes, so a row's bits change with
the number of rows in the batch. Here every output element is one fp32 sum walked over K from 0
to the end in tensor-core steps, never split, whatever the call's shape; only which rows and
columns a program computes (its tile) follows the shape. A tile's size does not change a row's
sums: on an H100 tiles of 64-128 rows, 16-256 columns and K steps of 64-256 gave every
output the same bits (docs/deterministic.md; `benchmarks/bench_gpu_invariant_gemm.py` checks
each configuration it times, tests/test_gpu_deterministic.py the row counts). So a call of few rows
(decode) takes narrow tiles, enough of them to keep every SM streaming the weight, and a call
of many rows (prefill) takes wide ones, which load each weight tile for more rows.

cuBLAS is faster at prefill sizes, and where its kernel for a shape does not split K it sums in
the same order (tensor-core steps walked over K from 0) and so gives the same bits. Which shapes
those are is cuBLAS's choice, so it is proven, not assumed: the first call of each (row count
rounded up to a multiple of 64, N, K, dtypes) runs both on a random input of that shape and keeps
cuBLAS for it only if every output matched (ProvenFastPath; the engine proves every row count
it can meet at start-up, batch_invariant.prove_fast_products). A call's bits are therefore
always the Triton kernel's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


class Tiles(NamedTuple):
    """A launch configuration: a program's tile and K step, its warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


GROUP_M = 8
# Few rows: 64-row tiles (a tensor-core instruction's height), the widest that still gives
# every other SM a program, the weight streamed in long K steps. Many rows: wide tiles, which
# load each weight tile for more rows. Picked from bench_gpu_invariant_gemm's sweep
# (benchmarks/results/gpu_h100_invariant_gemm.jsonl; docs/deterministic.md).
NARROW = (Tiles(64, 16, 256, 4, 4), Tiles(64, 32, 256, 4, 4), Tiles(64, 64, 128, 4, 4), Tiles(64, 128, 64, 4, 4))
WIDE = Tiles(128, 256, 64, 8, 3)
WIDE_FROM_ROWS = 1024


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    # Grouped order: GROUP_M row tiles share each column tile while it is in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_rows + k, mask=rows[:, None] < M, other=0.0)
            w = tl.load(w_cols + k, mask=cols[None, :] < N, other=0.0)
        else:
            x = tl.load(x_rows + k, mask=(rows[:, None] < M) & (k + ks[None, :] < K), other=0.0)
            w = tl.load(w_cols + k, mask=(cols[None, :] < N) & (k + ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _programs(m: int, n: int, tiles: Tiles) -> int:
    return triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)


def tiles_for(m: int, n: int, sms: int) -> Tiles:
    """WIDE from WIDE_FROM_ROWS rows on; else the widest NARROW tile giving at least half as
    many programs as the GPU has SMs (the narrowest when none does)."""
    if m >= WIDE_FROM_ROWS:
        return WIDE
    enough = [t for t in NARROW if 2 * _programs(m, n, t) >= sms]
    return enough[-1] if enough else NARROW[0]


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


class ProvenFastPath:
    """A faster product used per shape only where it gives the reference's bits: the first call
    of each shape key runs both on a random probe of that shape (strides and alignment too) and
    keeps the fast one for that key only if every output matched. A probe, not the call's own
    input, because a degenerate input (zeros, a warm-up's) could match by chance. On CUDA the
    verdict comes back without a host sync (_PendingProof): until it has, and for a key first
    met while a graph is being captured, calls run the reference, which has the same bits
    anyway. fast and reference: (x, weight, bias) -> x @ weight^T (+ bias). Calls of fewer than
    min_rows rows run the reference; row counts are padded up to a multiple of row_bucket, so
    few keys need a proof."""

    def __init__(self, fast, reference, min_rows: int, row_bucket: int):
        self.fast, self.reference = fast, reference
        self.min_rows, self.row_bucket = min_rows, row_bucket
        self.same_bits: dict[tuple, bool | _PendingProof] = {}

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The fast product, where proven for this shape; None where the caller must run the
        reference (too few rows, a shape that failed its proof, or one not proven yet)."""
        m = x.shape[0]
        if m < self.min_rows:
            return None
        rows = -(-m // self.row_bucket) * self.row_bucket
        exact = (x.stride(0), x.data_ptr() % 256 // x.element_size()) if rows == m else None
        key = _key(rows, weight, bias, x.dtype, exact)
        same = self.same_bits.get(key)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if same is None:
            if capturing:
                return None
            same = self.same_bits[key] = self._prove(rows, weight, bias, x.dtype, exact)
        if isinstance(same, _PendingProof):
            verdict = None if capturing else same.verdict()
            if verdict is None:
                return None
            same = self.same_bits[key] = verdict
        if not same:
            return None
        padded = x if rows == m else torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
        return self.fast(padded, weight, bias)[:m]

    def prove_rows(self, rows: int, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Starts the proof for calls of `rows` rows (a multiple of row_bucket) of `dtype`, unless
        met already: a call of fewer rows padded up to it, and one of exactly `rows` rows of a
        contiguous tensor at an aligned address (the same probe, so one proof answers both).
        Run before CUDA graphs are captured, so that their products may be proven too (settle())."""
        keys = [_key(rows, weight, bias, dtype, None), _key(rows, weight, bias, dtype, (weight.shape[1], 0))]
        if any(key not in self.same_bits for key in keys):
            proof = self._prove(rows, weight, bias, dtype, None)
            for key in keys:
                self.same_bits.setdefault(key, proof)

    def settle(self) -> None:
        """Waits for the device and reads every proof still on it: a graph captured next uses
        the fast product at each proven shape (a pending verdict cannot be read while capturing)."""
        if any(isinstance(v, _PendingProof) for v in self.same_bits.values()):
            torch.cuda.synchronize()
            self.same_bits = {k: v.verdict() if isinstance(v, _PendingProof) else v for k, v in self.same_bits.items()}

    def _prove(self, rows: int, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               exact: tuple[int, int] | None) -> bool | _PendingProof:
        """Whether fast and reference give the same bits on a random [rows, K] input: a fresh
        tensor for padded calls, else one with the call's row stride and pointer alignment
        (`exact`, in elements); on CUDA, a _PendingProof of it."""
        k = weight.shape[1]
        stride, offset = exact if exact is not None else (k, 0)
        generator = torch.Generator(device=weight.device).manual_seed(0)
        flat = torch.randn(offset + (rows - 1) * stride + k, generator=generator, device=weight.device).to(dtype)
        probe = flat.as_strided((rows, k), (stride, 1), offset)
        fast, reference = self.fast(probe, weight, bias), self.reference(probe, weight, bias)
        if weight.is_cuda:
            return _PendingProof(fast.shape == reference.shape and (fast == reference).all())
        return torch.equal(fast, reference)


def _key(rows: int, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
         exact: tuple[int, int] | None) -> tuple:
    """A proof's key. cuBLAS picks its kernel by shape, strides and pointer alignment: all are in
    it (a call of exactly `rows` rows also by its row stride and alignment, `exact`; a padded
    call's input is a fresh tensor)."""
    return (rows, weight.shape[0], weight.shape[1], dtype, weight.dtype, None if bias is None else bias.dtype,
            weight.device.index) + (exact or ())


class _PendingProof:
    """A proof still on the device: its verdict is copied into pinned host memory behind the
    products, and read once an event says it is there. torch.equal would wait for the whole
    queue (the running step too), a stall on the serving path for every shape met first."""

    def __init__(self, same: torch.Tensor | bool):
        self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._host.copy_(same if isinstance(same, torch.Tensor) else torch.tensor(same), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def verdict(self) -> bool | None:
        """Whether the products matched; None while the device is still on it."""
        return bool(self._host) if self._copied.query() else None


def _picked_triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _triton_linear(x, weight, bias, tiles_for(x.shape[0], weight.shape[0], _sm_count(x.device)))


# cuBLAS from 64 rows on: below that the Triton kernel is about as fast (and cuBLAS splits K).
CUBLAS = ProvenFastPath(F.linear, _picked_triton_linear, min_rows=64, row_bucket=64)


def invariant_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each row the same bits
    whatever M is: cuBLAS's where proven equal (CUBLAS), else the Triton kernel's.
    tiles: run the Triton kernel in this launch configuration (benchmarks)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if tiles is None:
        proven = CUBLAS.run(x, weight, bias)
        if proven is not None:
            return proven
    return _triton_linear(x, weight, bias, tiles) if tiles else _picked_triton_linear(x, weight, bias)


def _triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _gemm_kernel[(_programs(m, n, tiles),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=GROUP_M, EVEN_K=k % tiles.block_k == 0, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=False)
    return y
