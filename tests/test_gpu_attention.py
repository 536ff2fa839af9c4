"""FlashInfer attention and the Triton kernels against their torch references, on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.executor.mem_pool import KVPool
from radixlm.srt.scheduler.kv_memory import PageAllocator
from radixlm.srt.executor.models.ops import TorchOps
from gpu_helpers import cuda_batch

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
DTYPE = torch.bfloat16


def _setup(page_size: int):
    from radixlm.srt.executor.attention.flashinfer_backend import FlashInferBackend
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    alloc = PageAllocator(capacity_tokens=8192, page_size=page_size)
    pool = KVPool(alloc.num_pages * page_size, 1, NUM_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    table = torch.zeros(16, 2048, dtype=torch.int64)  # host-side, as ReqToTokenTable keeps it
    scale = 1.0 / math.sqrt(HEAD_DIM)
    flash = FlashInferBackend(pool, table, page_size, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale, DTYPE)
    native = TorchNativeBackend(pool, table, scale)
    return alloc, pool, table, flash, native


def _fill_prefixes(alloc, pool, table, rows, prefix_lens, gen):
    """Allocates and writes random K/V for each request's cached prefix."""
    for row, n in zip(rows, prefix_lens):
        if n:
            slots = torch.tensor(alloc.alloc(0, n, None))
            table[row, :n] = slots
            slots = slots.cuda()
            for buf in (pool.k_buffers[0], pool.v_buffers[0]):
                buf[:, slots] = torch.randn(NUM_KV_HEADS, n, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)


def _new_slots(alloc, table, rows, prefix_lens, extend_lens) -> list[int]:
    out = []
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        last = int(table[row, p - 1]) if p else None
        slots = alloc.alloc(p, e, last)
        table[row, p:p + e] = torch.tensor(slots)
        out.extend(slots)
    return out


def _compare(flash, native, batch, gen):
    total = sum(batch.extend_lens_cpu)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    flash.plan(batch)
    got = flash.forward(q, k, v, 0).float()
    native.plan(batch)
    want = native.forward(q.float(), k.float(), v.float(), 0).float()  # fp32 math where it can
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_flashinfer_matches_torch_native_on_extend_and_decode(page_size):
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    alloc, pool, table, flash, native = _setup(page_size)
    # Extend: no prefix, a long cached prefix, a prefix ending mid-page, one new token after a
    # prefix (decode-like), and a long fresh prompt -- all in one batch.
    rows = [3, 0, 7, 5, 9]
    prefix_lens = [0, 300, 37, 129, 0]
    extend_lens = [17, 64, 1, 5, 700]
    _fill_prefixes(alloc, pool, table, rows, prefix_lens, gen)
    slots = _new_slots(alloc, table, rows, prefix_lens, extend_lens)
    _compare(flash, native, cuda_batch(ForwardMode.EXTEND, rows, prefix_lens, extend_lens, slots), gen)
    # Decode steps on top of what the extend wrote, lengths crossing page boundaries.
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    for _ in range(3):
        slots = _new_slots(alloc, table, rows, seq, [1] * len(rows))
        _compare(flash, native, cuda_batch(ForwardMode.DECODE, rows, seq, [1] * len(rows), slots), gen)
        seq = [s + 1 for s in seq]


def test_triton_ops_match_torch_ops():
    from radixlm.srt.executor.models.ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, generator=gen, device="cuda").to(DTYPE)
    res = torch.randn(37, 4096, generator=gen, device="cuda").to(DTYPE)
    w = torch.rand(4096, generator=gen, device="cuda").to(DTYPE)
    torch.testing.assert_close(TritonOps().rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5), atol=2e-2, rtol=2e-2)
    want, want_res = TorchOps.add_rms_norm(x, res, w, 1e-5)
    got, got_res = TritonOps().add_rms_norm(x, res.clone(), w, 1e-5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got_res, want_res)
    gate_up = torch.randn(37, 2 * 1000, generator=gen, device="cuda").to(DTYPE)
    torch.testing.assert_close(TritonOps().silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up), atol=1e-2, rtol=1e-2)
    qkv = torch.randn(37, (8 + 2 * 2) * 128, generator=gen, device="cuda").to(DTYPE)
    q, k = qkv[:, :1024].view(37, 8, 128), qkv[:, 1024:1280].view(37, 2, 128)
    pos = torch.randint(0, 4000, (37,), generator=gen, device="cuda")
    from radixlm.srt.executor.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(None, 128, 500000.0, 4096, device="cuda")
    cos, sin = rope.cos_cache.to(DTYPE), rope.sin_cache.to(DTYPE)
    want_q, want_k = TorchOps.rotary(pos, q.clone(), k.clone(), cos, sin)
    got_q, got_k = TritonOps().rotary(pos, q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_k, want_k, atol=1e-2, rtol=1e-2)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place inside the fused qkv output


def test_triton_kv_store_matches_index_copy():
    pool = KVPool(100, 1, 2, 128, DTYPE, "cuda")
    assert pool._triton_store
    k = torch.randn(5, 2, 128, device="cuda").to(DTYPE)
    v = torch.randn(5, 2, 128, device="cuda").to(DTYPE)
    slots = torch.tensor([7, 3, 99, 50, 1], device="cuda")
    pool.store(0, slots, k, v)
    assert torch.equal(pool.k_buffers[0][:, slots].transpose(0, 1), k)
    assert torch.equal(pool.v_buffers[0][:, slots].transpose(0, 1), v)
    untouched = torch.ones(100, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not pool.k_buffers[0][:, untouched].any() and not pool.v_buffers[0][:, untouched].any()
