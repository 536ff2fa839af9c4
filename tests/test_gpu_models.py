"""The new families' GPU paths against their torch references, on CUDA: FlashInfer with sliding
windows and soft-capping against torch-native attention, the fused Triton MoE against the torch
MoE, and whole tiny models (Mistral with a window, Gemma 2, Mixtral) served with FlashInfer
and CUDA graphs against the same models on torch-native attention."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gpu_helpers import assert_same_greedy, llama3_tokenizer_path
from radixlm.srt.executor.attention.layer_spec import LayerAttention
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.executor.mem_pool import KVPool
from radixlm.srt.scheduler.kv_memory import PageAllocator
from gpu_helpers import cuda_batch
from test_gpu_attention import _new_slots

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
DTYPE = torch.bfloat16
# Layer 0: a window of 48 tokens; layer 1: full attention; both soft-capped (Gemma 2's way).
LAYERS = [LayerAttention(48, 30.0), LayerAttention(None, 30.0)]


def _setup(page_size: int):
    from radixlm.srt.executor.attention.flashinfer_backend import FlashInferBackend
    from radixlm.srt.executor.attention.torch_native import TorchNativeBackend

    alloc = PageAllocator(capacity_tokens=8192, page_size=page_size)
    pool = KVPool(alloc.num_pages * page_size, len(LAYERS), NUM_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    table = torch.zeros(16, 2048, dtype=torch.int64)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    flash = FlashInferBackend(pool, table, page_size, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale, DTYPE, layers=LAYERS)
    native = TorchNativeBackend(pool, table, scale, layers=LAYERS)
    return alloc, pool, table, flash, native


def _fill(alloc, pool, table, rows, prefix_lens, gen):
    for row, n in zip(rows, prefix_lens):
        if n:
            slots = torch.tensor(alloc.alloc(0, n, None))
            table[row, :n] = slots
            for layer in range(len(LAYERS)):
                for buf in (pool.k_buffers[layer], pool.v_buffers[layer]):
                    buf[:, slots.cuda()] = torch.randn(NUM_KV_HEADS, n, HEAD_DIM, generator=gen,
                                                       device="cuda").to(DTYPE)


def _compare_layers(flash, native, pool, batch, gen):
    total = sum(batch.extend_lens_cpu)
    flash.plan(batch)
    native.plan(batch)
    for layer in range(len(LAYERS)):
        q = (3 * torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda")).to(DTYPE)  # scores past the cap
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE)
        got = flash.forward(q, k, v, layer).float()
        want = native.forward(q.float(), k.float(), v.float(), layer).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"layer {layer}")


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_windows_and_softcap_match_torch_native(page_size):
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    alloc, pool, table, flash, native = _setup(page_size)
    # Cached prefixes shorter and longer than the window, a fresh prompt longer than it, a decode-like row.
    rows, prefix_lens, extend_lens = [3, 0, 7, 5], [0, 300, 37, 129], [200, 64, 1, 5]
    _fill(alloc, pool, table, rows, prefix_lens, gen)
    slots = _new_slots(alloc, table, rows, prefix_lens, extend_lens)
    _compare_layers(flash, native, pool, cuda_batch(ForwardMode.EXTEND, rows, prefix_lens, extend_lens, slots), gen)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    for _ in range(3):  # decode steps, every request past the window
        slots = _new_slots(alloc, table, rows, seq, [1] * len(rows))
        _compare_layers(flash, native, pool, cuda_batch(ForwardMode.DECODE, rows, seq, [1] * len(rows), slots), gen)
        seq = [s + 1 for s in seq]


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 333])
def test_fused_moe_matches_torch_reference(num_tokens):
    from radixlm.srt.executor.models.moe import expert_forward, route
    from radixlm.srt.executor.models.moe_triton import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    experts, hidden, inter = 8, 512, 1024
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(DTYPE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden ** 0.5).to(DTYPE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter ** 0.5).to(DTYPE)
    weights, ids = route(torch.randn(num_tokens, experts, generator=gen, device="cuda"), 2, True)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = expert_forward(x.float(), w13.float(), w2.float(), weights, ids).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_fused_moe_replays_in_a_cuda_graph():
    from radixlm.srt.executor.models.moe import route
    from radixlm.srt.executor.models.moe_triton import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 256, generator=gen, device="cuda").to(DTYPE)
    w13 = (torch.randn(8, 1024, 256, generator=gen, device="cuda") / 16).to(DTYPE)
    w2 = (torch.randn(8, 256, 512, generator=gen, device="cuda") / 23).to(DTYPE)
    logits = torch.randn(4, 8, generator=gen, device="cuda")
    run = lambda: fused_moe(x, w13, w2, *route(logits, 2, True))  # noqa: E731
    run()  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    logits.copy_(torch.randn(4, 8, generator=gen, device="cuda"))  # other experts
    graph.replay()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)


def _tiny_model(kind: str, path: Path) -> None:
    import transformers as tf

    shape = dict(vocab_size=128256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
                 bos_token_id=128000, eos_token_id=128001)
    config = {
        "mistral": lambda: tf.MistralConfig(**shape, sliding_window=64),
        "gemma2": lambda: tf.Gemma2Config(**shape, sliding_window=64, query_pre_attn_scalar=128,
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "mixtral": lambda: tf.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
    }[kind]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02 if "embed" in name else 0.1 if "norm" in name else 0.08)
    model.save_pretrained(path)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "mixtral"])
def test_served_with_flashinfer_and_graphs_like_torch_native(kind, tmp_path):
    from radixlm.srt import Engine

    _tiny_model(kind, tmp_path)
    prompts = [[1000 + (37 * i + 11 * j) % 5000 for j in range(n)] for i, n in enumerate([150, 90, 30, 200])]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    outputs = {}
    for name, kwargs in {"torch_native": dict(attention_backend="torch_native", disable_cuda_graph=True),
                         "flashinfer": dict(attention_backend="flashinfer", disable_cuda_graph=True),
                         "flashinfer_graphs": dict(attention_backend="flashinfer", cuda_graph_max_bs=8)}.items():
        engine = Engine(str(tmp_path), tokenizer_path=llama3_tokenizer_path(), dtype="bfloat16",
                        max_total_tokens=16384, chunked_prefill_size=64, **kwargs)
        try:
            outputs[name] = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                            top_logprobs_num=2)
        finally:
            engine.shutdown()
    assert_same_greedy(outputs["torch_native"], outputs["flashinfer"])
    assert_same_greedy(outputs["torch_native"], outputs["flashinfer_graphs"])
