"""FP8 on CUDA (Hopper): the FP8 linear through torch._scaled_mm and the Triton quantizer
against their references, FlashInfer reading an FP8 KV pool against torch_native on the same
pool, and engines with FP8 weights (and FP8 KV): CUDA-graph replay equals eager."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gpu_helpers import assert_same_greedy, cuda_batch, llama3_tokenizer_path, small_llama_config
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.executor.mem_pool import KVPool, read_kv
from radixlm.srt.executor.quantization.fp8 import GEMV_MAX_ROWS, Fp8Linear, quantize_per_token, quantize_per_token_torch
from radixlm.srt.scheduler.kv_memory import PageAllocator

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
DTYPE = torch.bfloat16


# ---- the FP8 linear ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_fp8_linear_cuda_matches_dequantized_reference(rows):
    torch.manual_seed(0)
    lin = nn.Linear(512, 1536, bias=True, device="cuda", dtype=DTYPE)
    q = Fp8Linear.from_linear(lin)
    assert q.weight.dtype == FP8 and q.weight.is_contiguous() and q.weight_scale.shape == (1, 1536)
    x = torch.randn(rows, 512, device="cuda", dtype=DTYPE)
    got = q(x)
    assert got.dtype == DTYPE and got.shape == (rows, 1536)
    xq, xs = quantize_per_token_torch(x)
    x_used = x.float() if rows <= GEMV_MAX_ROWS else xq.float() * xs  # fp8_gemv leaves x unquantized
    want = x_used @ q.dequantized_weight().t() + lin.bias.float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    exact = lin(x).float()
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (960, 576), (100, 200)])
def test_decode_sized_batches_take_the_gemv_kernel(rows, shape):
    """Up to GEMV_MAX_ROWS rows the module runs fp8_gemv (x unquantized: only the weight's own
    rounding), beyond that quantize + torch._scaled_mm; every tile configuration of the kernel,
    split-K or not, computes the same product."""
    from radixlm.srt.executor.quantization.fp8_gemv import GemvConfig, fp8_gemv

    n, k = shape
    if rows > GEMV_MAX_ROWS and (n % 16 or k % 16):
        pytest.skip("_scaled_mm needs multiples of 16 (quantize_model_fp8 leaves such projections unquantized)")
    torch.manual_seed(rows)
    q = Fp8Linear.from_linear(nn.Linear(k, n, bias=False, device="cuda", dtype=DTYPE))
    x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
    if rows <= GEMV_MAX_ROWS:
        want = x.float() @ q.dequantized_weight().t()
        outs = [q(x).float()] + [fp8_gemv(x, q.weight, q.weight_scale, DTYPE, GemvConfig(*c)).float()
                                 for c in ((16, 128, 1, 4, 3), (64, 256, 2, 8, 4), (32, 128, 4, 4, 5))]
    else:
        xq, xs = quantize_per_token_torch(x)
        want = torch._scaled_mm(xq, q.weight.t(), scale_a=xs, scale_b=q.weight_scale, out_dtype=torch.float32)
        outs = [q(x).float()]
    for got in outs:
        rel = (got - want).norm() / want.norm()
        assert rel < 5e-3, rel  # bf16 output rounding (and, for _scaled_mm, an x value moved by one e4m3 step)


def test_fp8_linear_cuda_float16_model():
    """fp16 models: the row-wise GEMM makes bf16, cast to fp16 after."""
    lin = nn.Linear(256, 128, bias=False, device="cuda", dtype=torch.float16)
    q = Fp8Linear.from_linear(lin)
    x = torch.randn(5, 256, device="cuda", dtype=torch.float16)
    out = q(x)
    assert out.dtype == torch.float16
    assert ((out.float() - lin(x).float()).norm() / lin(x).float().norm()).item() < 0.05


@pytest.mark.parametrize("shape", [(1, 4096), (7, 14336), (33, 576), (128, 100)])
def test_triton_per_token_quant_matches_torch(shape):
    x = torch.randn(*shape, device="cuda", dtype=DTYPE) * torch.logspace(-3, 2, shape[0], device="cuda")[:, None]
    x[-1] = 0  # an all-zero token: the smallest scale, zeros out
    got_q, got_s = quantize_per_token(x)
    want_q, want_s = quantize_per_token_torch(x)
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    # Triton's fp32 division may round differently in the last bit, moving a value that sits on
    # a rounding boundary by one e4m3 step (at most 1/8 relative).
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=0.126, atol=0)
    assert (got_q.float() == want_q.float()).float().mean() > 0.999


@pytest.mark.parametrize("rows", [17, 300])
def test_fused_norm_and_activation_quantization_match_the_separate_kernels(rows):
    """rms_norm_quant and silu_and_mul_quant write the very bytes and scales of the op followed
    by quantize_per_token (bf16 on the GPU; the interpreter test covers fp16)."""
    from radixlm.srt.executor.models import triton_ops
    from radixlm.srt.executor.quantization import fp8_triton

    torch.manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=DTYPE) * 3
    res = torch.randn(rows, 4096, device="cuda", dtype=DTYPE)
    w = torch.rand(4096, device="cuda", dtype=DTYPE) + 0.5
    r1, r2 = res.clone(), res.clone()
    want = quantize_per_token(triton_ops.add_rms_norm(x, r1, w, 1e-5)[0])
    got = fp8_triton.rms_norm_quant(x, r2, w, 1e-5)
    assert torch.equal(r1, r2)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=DTYPE) * 4
    want = quantize_per_token(triton_ops.silu_and_mul(gate_up))
    got = fp8_triton.silu_and_mul_quant(gate_up)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def test_triton_fp8_kv_store_matches_torch():
    pool_t = KVPool(64, 1, NUM_KV_HEADS, HEAD_DIM, FP8, "cuda")
    pool_t._triton_store = False
    pool_k = KVPool(64, 1, NUM_KV_HEADS, HEAD_DIM, FP8, "cuda")
    assert pool_k._triton_store
    qkv = torch.randn(5, 3 * NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) * 50
    k, v = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS]  # strided views, as the model passes them
    k[0, 0, 0] = 1000.0  # past e4m3's 448: saturates
    slots = torch.tensor([3, 9, 1, 40, 63], device="cuda")
    for pool in (pool_t, pool_k):
        pool.store(0, slots, k, v)
    for a, b in ((pool_t.k_buffers[0], pool_k.k_buffers[0]), (pool_t.v_buffers[0], pool_k.v_buffers[0])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert read_kv(pool_k.k_buffers[0], slots[:1], torch.float32)[0, 0, 0] == 448


# ---- FlashInfer on an FP8 pool -----------------------------------------------------------------


def _setup(page_size: int):
    from radixlm.srt.executor.attention.flashinfer_backend import FlashInferBackend
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    alloc = PageAllocator(capacity_tokens=8192, page_size=page_size)
    pool = KVPool(alloc.num_pages * page_size, 1, NUM_KV_HEADS, HEAD_DIM, FP8, "cuda")
    table = torch.zeros(16, 2048, dtype=torch.int64)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    flash = FlashInferBackend(pool, table, page_size, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale, DTYPE, cascade=False)
    native = TorchNativeBackend(pool, table, scale, cascade=False)
    return alloc, pool, table, flash, native


def _fill(alloc, pool, table, rows, prefix_lens, extend_lens, gen):
    """Random K/V stored (quantized) for each cached prefix; slots for the new tokens."""
    out = []
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        if p:
            slots = alloc.alloc(0, p, None)
            table[row, :p] = torch.tensor(slots)
            kv = torch.randn(2, p, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
            pool.store(0, torch.tensor(slots, device="cuda"), kv[0], kv[1])
        slots = alloc.alloc(p, e, int(table[row, p - 1]) if p else None)
        table[row, p:p + e] = torch.tensor(slots)
        out.extend(slots)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["decode", "extend"])
def test_flashinfer_reads_fp8_kv_like_torch_native(page_size, case):
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    alloc, pool, table, flash, native = _setup(page_size)
    rows = [0, 1, 2, 3]
    if case == "decode":
        prefix_lens, extend_lens, mode = [5, 130, 700, 1], [1, 1, 1, 1], ForwardMode.DECODE
    else:
        prefix_lens, extend_lens, mode = [0, 17, 300, 64], [9, 40, 1, 128], ForwardMode.EXTEND
    out_slots = _fill(alloc, pool, table, rows, prefix_lens, extend_lens, gen)
    batch = cuda_batch(mode, rows, prefix_lens, extend_lens, out_slots)
    total = sum(extend_lens)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
    flash.plan(batch)
    got = flash.forward(q, k, v, 0).float()
    # Both attend an extend's new tokens as computed (FlashInfer: ragged prefill, merged with the
    # prefixes' FP8 pages) and what is cached, or a decode's own new token, as the pool holds it.
    native.plan(batch)
    want = native.forward(q.float(), k.float(), v.float(), 0).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_flashinfer_fp8_kv_with_scales():
    """k_scale / v_scale reach the kernels: a pool with scale 2 holds half the values and
    attends to the same result."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    results = []
    for scale in (1.0, 2.0):
        alloc = PageAllocator(capacity_tokens=4096, page_size=1)
        pool = KVPool(alloc.num_pages, 1, NUM_KV_HEADS, HEAD_DIM, FP8, "cuda", k_scale=scale, v_scale=scale)
        from radixlm.srt.executor.attention.flashinfer_backend import FlashInferBackend

        table = torch.zeros(4, 1024, dtype=torch.int64)
        flash = FlashInferBackend(pool, table, 1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, DTYPE,
                                  cascade=False)
        gen.manual_seed(7)
        out_slots = _fill(alloc, pool, table, [0, 1], [100, 300], [1, 1], gen)
        batch = cuda_batch(ForwardMode.DECODE, [0, 1], [100, 300], [1, 1], out_slots)
        q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        kv = torch.randn(2, 2, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        flash.plan(batch)
        results.append(flash.forward(q, kv[0], kv[1], 0).float())
    torch.testing.assert_close(results[0], results[1], atol=3e-2, rtol=3e-2)


# ---- engines -----------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    shared = [rng.randrange(1000, 100000) for _ in range(300)]
    prompts = [shared + [rng.randrange(1000, 100000) for _ in range(n)] for n in (1, 7, 40)]
    return prompts + [[rng.randrange(1000, 100000) for _ in range(n)] for n in (3, 64, 500)]


def _run(config_path: str, **kwargs) -> list[dict]:
    from radixlm.srt import Engine
    from radixlm.srt.executor.quantization.fp8 import Fp8Linear as Fp8

    engine = Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=16384,
                    max_running_requests=8, **kwargs)
    try:
        model = engine.scheduler.engine.runner.model
        if kwargs.get("quantization") == "fp8":
            assert sum(isinstance(m, Fp8) for m in model.modules()) == 4 * len(model.layers)
        params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
        outs = engine.generate(input_ids=_prompts(), sampling_params=params, return_logprob=True, top_logprobs_num=2)
        assert engine.scheduler.kv_stats()["leaked"] == 0
        return outs
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return small_llama_config(tmp_path_factory.mktemp("small-llama-fp8"))


def test_fp8_weights_cuda_graph_replay_equals_eager(config_path):
    eager = _run(config_path, quantization="fp8", attention_backend="flashinfer", disable_cuda_graph=True)
    graphs = _run(config_path, quantization="fp8", attention_backend="flashinfer")
    assert_same_greedy(eager, graphs)


def test_fp8_weights_and_kv_flashinfer_graphs_match_torch_native(config_path):
    native = _run(config_path, quantization="fp8", kv_cache_dtype="fp8_e4m3", attention_backend="torch_native",
                  disable_cuda_graph=True)
    flash = _run(config_path, quantization="fp8", kv_cache_dtype="fp8_e4m3", attention_backend="flashinfer")
    assert_same_greedy(native, flash)


def test_norm_and_activation_hand_fp8_projections_their_input_quantized(config_path):
    """Prefill rows reach the FP8 GEMMs quantized by the norm and SiLU-and-mul themselves; the
    outputs and logprobs are exactly those of the separate quantization kernels."""
    fused = _run(config_path, quantization="fp8", attention_backend="flashinfer")
    separate = _run(config_path, quantization="fp8", attention_backend="flashinfer", disable_fused_fp8_quantization=True)
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in separate]
    assert [o["meta_info"]["output_token_logprobs"] for o in fused] == \
        [o["meta_info"]["output_token_logprobs"] for o in separate]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_rotation_and_kv_store_in_one_launch_change_no_output(config_path, kv_cache_dtype, monkeypatch):
    """The FlashInfer backend rotates q and k and stores K/V in one kernel; the outputs and
    logprobs are exactly those of the rotary kernel followed by the KV store (prefill with
    shared prefixes, and decode under CUDA graphs), over a bf16 pool and an FP8 one."""
    calls = []
    fused_store = KVPool.rotate_and_store
    monkeypatch.setattr(KVPool, "rotate_and_store", lambda self, *a: calls.append(1) or fused_store(self, *a))
    fused = _run(config_path, kv_cache_dtype=kv_cache_dtype, attention_backend="flashinfer")
    assert calls  # the fused path ran
    calls.clear()
    separate = _run(config_path, kv_cache_dtype=kv_cache_dtype, attention_backend="flashinfer",
                    disable_fused_rotary_store=True)
    assert not calls  # the rotary kernel, then the KV store
    assert [o["output_ids"] for o in fused] == [o["output_ids"] for o in separate]
    assert [o["meta_info"]["output_token_logprobs"] for o in fused] == \
        [o["meta_info"]["output_token_logprobs"] for o in separate]
