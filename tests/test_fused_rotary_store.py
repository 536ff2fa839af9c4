"""The rotation and the KV store in one launch (triton_ops.rotary_store_kv, what the FlashInfer
backend runs per layer) write the same bytes as the rotary kernel followed by the KV store, over
a model-dtype pool and an FP8 one, run by Triton's CPU interpreter."""

from __future__ import annotations

from triton_interpreter import run_in_interpreter

CHECK = """
import torch
from radixlm.srt.executor.models import triton_ops
from radixlm.srt.executor.models.ops import TorchOps
from radixlm.srt.executor.models.rotary import RotaryEmbedding
from radixlm.srt.executor.quantization.fp8_triton import store_kv_fp8
torch.manual_seed(0)
results = []
for hq, hkv, d, pool_dtype in [(8, 2, 64, torch.half), (7, 1, 32, torch.half), (8, 2, 64, torch.float8_e4m3fn)]:
    tokens, slots_total = 5, 16
    rotary = RotaryEmbedding(None, d, 10000.0, 64)
    positions = torch.tensor([0, 3, 17, 40, 63])
    slots = torch.tensor([9, 2, 14, 5, 11])
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d).half() * 3  # as the fused projection writes it
    def views(t):
        q, k, v = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    pools = [(torch.zeros(hkv, slots_total, d).to(pool_dtype), torch.zeros(hkv, slots_total, d).to(pool_dtype))
             for _ in range(2)]
    a, b = qkv.clone(), qkv.clone()
    qa, ka, va = views(a)
    want_q, want_k = TorchOps.rotary(positions, qa, ka, rotary.cos_cache, rotary.sin_cache)
    triton_ops.rotary_inplace(positions, qa, rotary.cos_cache, rotary.sin_cache)
    triton_ops.rotary_inplace(positions, ka, rotary.cos_cache, rotary.sin_cache)
    if pool_dtype == torch.float8_e4m3fn:
        store_kv_fp8(*pools[0], slots, ka, va, 0.5, 1.5)
        scales = (0.5, 1.5)
    else:
        triton_ops.store_kv(*pools[0], slots, ka, va)
        scales = (1.0, 1.0)
    qb, kb, vb = views(b)
    triton_ops.rotary_store_kv(positions, qb, kb, vb, rotary.cos_cache, rotary.sin_cache, *pools[1], slots, *scales)
    results.append(torch.equal(qa, want_q) and torch.equal(ka, want_k) and torch.equal(a, b)
                   and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(pools[0], pools[1]))
                   and bool(pools[1][0].float().abs().sum() > 0))
print(results)
"""


def test_rotary_and_kv_store_in_one_launch_write_the_same_bytes_as_two():
    assert run_in_interpreter(CHECK) == "[True, True, True]"
