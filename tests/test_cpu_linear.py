"""CPU projections through oneDNN over weights packed at load (srt/executor/cpu_linear.py): the
product is F.linear's up to rounding at any row count and leading axes, the default model packs
every projection and its tied LM head without keeping the plain weights beside them, and
`disable_onednn_linear` keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.srt.executor.cpu_linear import PackedHead, PackedLinear, onednn_available, pack_projections

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (17, 64), (3, 5, 64)])
@pytest.mark.parametrize("min_rows", [1, 2])
def test_a_packed_projection_computes_f_linear(shape, min_rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(*shape)
    packed = PackedLinear(weight, bias, min_rows)
    out = packed(x)
    assert out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert packed.weight.shape == weight.shape and packed.weight.dtype == weight.dtype


class _TinyLM(nn.Module):
    """What pack_projections reads of a model: projections, an LM head's weight and product."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.lm_head = None if tied else nn.Linear(16, 50, bias=False)
        self.head_linear = lambda x, weight: F.linear(x, weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_linear(self.proj(x), self.lm_head_weight)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pack_projections_packs_the_head_too_and_only_float32(tied):
    torch.manual_seed(0)
    model = _TinyLM(tied)
    x = torch.randn(3, 16)
    want = model(x)
    assert pack_projections(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head_linear, PackedHead)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert pack_projections(model, min_rows=2) == 0  # packed once; the deterministic mode's padding added
    assert model.proj.min_rows == 2 and model.head_linear.linear.min_rows == 2
    half = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_projections(half) == 0 and isinstance(half[0], nn.Linear)


def test_the_default_model_runs_packed_projections_without_a_second_copy(engine):
    model = engine.scheduler.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * 30 + 1  # fused q|k|v, o_proj, fused gate|up, down in each of 30 layers; the tied head
    assert isinstance(model.head_linear, PackedHead)
    plain = [name for name, p in model.named_parameters() if "proj" in name]
    assert plain == []  # the packed tensors replaced the stored weights


def test_disable_onednn_linear_keeps_f_linear():
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=512, disable_onednn_linear=True)
    try:
        model = eng.scheduler.engine.runner.model
        assert not any(isinstance(m, (PackedLinear, PackedHead)) for m in model.modules())
        assert eng.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})["text"]
    finally:
        eng.shutdown()
