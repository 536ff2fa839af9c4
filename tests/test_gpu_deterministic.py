"""--enable-deterministic-inference on CUDA (bf16, overlap scheduling on; the flag runs decode
eagerly, without CUDA graphs): the CPU suite's guarantees (test_deterministic.py) on dummy
weights in four layers of the Llama-3.1-8B shape, and the batch-invariant GEMM against cuBLAS.
Each guarantee is checked to fail without the flag.

On an H100 (2026-12-05), on a smaller model (hidden 512, intermediate 1024) every guarantee held
with the flag, and without it neither the engine nor cuBLAS at 4096 x 14336 varied with the
batch: the controls then could not fail, so they moved to the 8B model's layer shapes, where
cuBLAS switches kernels (split-K) by row count. Not run on a GPU since."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.models import LLAMA_8B_CONFIG
from gpu_helpers import llama3_tokenizer_path
from test_deterministic import (_answers_beside_companions, _loglikelihoods, _prefix_cases,
                                assert_one_answer_per_prompt)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    config = json.loads(LLAMA_8B_CONFIG.read_text())
    path = tmp_path_factory.mktemp("det") / "config.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return str(path)


def _engine(config_path, **kwargs):
    from radixlm.srt import Engine

    return Engine(config_path, load_format="dummy", tokenizer_path=llama3_tokenizer_path(), max_total_tokens=32768,
                  **kwargs)


@pytest.fixture(scope="module")
def det_engine(config_path):
    eng = _engine(config_path, enable_deterministic_inference=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def plain_engine(config_path):
    eng = _engine(config_path)
    yield eng
    eng.shutdown()


def _rows_vary(linear, x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """Row counts at which row 0 of linear(x[:m]) differs from its value at m = 64."""
    ref = linear(x[:64], weight)[0]
    return [m for m in (1, 2, 3, 4, 7, 8, 16, 33, 100, 256, 1000, 4096) if not torch.equal(linear(x[:m], weight)[0], ref)]


def test_the_gemm_gives_a_row_the_same_bits_at_every_batch_size():
    import torch.nn.functional as F

    from radixlm.srt.executor.batch_invariant_gemm import invariant_linear_cuda

    torch.manual_seed(0)
    cublas_varies = False
    # The 8B model's projections: qkv, o, gate|up, down (fan in, fan out).
    for fan_in, fan_out in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        x = torch.randn(4096, fan_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) / 64
        assert _rows_vary(invariant_linear_cuda, x, w) == [], (fan_in, fan_out)
        cublas_varies |= bool(_rows_vary(F.linear, x, w))  # the control
        torch.testing.assert_close(invariant_linear_cuda(x[:300], w), F.linear(x[:300], w), rtol=2e-2, atol=2e-2)
    assert cublas_varies


def test_companions_do_not_change_the_answer(det_engine, plain_engine):
    greedy, seeded = _answers_beside_companions(det_engine, 30)
    assert len(greedy) == 1 and len(seeded) == 1
    greedy, seeded = _answers_beside_companions(plain_engine, 10)
    assert len(greedy) > 1 or len(seeded) > 1


def test_cached_and_chunked_prefixes_give_the_same_answer(det_engine, plain_engine, config_path):
    cases = {f"whole, {name}": value for name, value in _prefix_cases(det_engine).items()}
    for chunk in (64, 256):
        eng = _engine(config_path, enable_deterministic_inference=True, chunked_prefill_size=chunk)
        try:
            cases.update({f"chunks of {chunk}, {name}": value
                          for name, value in _prefix_cases(eng, ("cold", "partly cached")).items()})
        finally:
            eng.shutdown()
    assert_one_answer_per_prompt(cases)
    control = _prefix_cases(plain_engine)
    assert len(set(control.values())) > 1


def test_loglikelihood_scores_do_not_depend_on_the_batch_size(det_engine, plain_engine):
    for eng, same in ((det_engine, True), (plain_engine, False)):
        eng.flush_cache()
        one = _loglikelihoods(eng, 1)
        eng.flush_cache()
        assert (_loglikelihoods(eng, 32) == one) == same
