"""The attention backends' CUDA-graph interface, on CPU: who may be captured, and the order in
which the graph runner calls a capturable backend's hooks (capture and replay stubbed out)."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.srt.executor import cuda_graph_runner
from radixlm.srt.executor.attention.base import DEFAULT_GRAPH_VARIANT, AttentionBackend, missing_cuda_graph_hooks
from radixlm.srt.executor.attention.torch_native import TorchNativeBackend
from radixlm.srt.executor.cuda_graph_runner import CudaGraphRunner, check_capturable
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.mem_pool import KVPool

VOCAB = 11


def _torch_native(cls=TorchNativeBackend) -> TorchNativeBackend:
    pool = KVPool(64, 1, 1, 8, torch.float32, "cpu")
    return cls(pool, torch.zeros(4, 16, dtype=torch.int64), scale=1.0)


def _decode_batch(num_reqs: int) -> ForwardBatch:
    rows = list(range(num_reqs))
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.arange(1, num_reqs + 1),
                        positions=torch.full((num_reqs,), 5), out_cache_loc=torch.arange(10, 10 + num_reqs),
                        req_pool_indices=torch.tensor(rows), req_pool_indices_cpu=rows,
                        seq_lens=torch.full((num_reqs,), 6), seq_lens_cpu=[6] * num_reqs,
                        prefix_lens_cpu=[5] * num_reqs, extend_lens_cpu=[1] * num_reqs,
                        logit_rows=torch.arange(num_reqs))


def test_torch_native_says_it_cannot_be_captured():
    backend = _torch_native()
    assert backend.supports_cuda_graph is False
    with pytest.raises(ValueError, match="TorchNativeBackend cannot be captured in CUDA graphs"):
        check_capturable(backend)


def test_backend_claiming_graphs_without_the_hooks_is_refused_by_name():
    class HalfDone(TorchNativeBackend):
        @property
        def supports_cuda_graph(self) -> bool:
            return True

        def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
            pass

    with pytest.raises(TypeError, match="HalfDone says it supports CUDA graphs but does not implement "
                                        "cuda_graph_variants, capture_cuda_graph_plan, replay_cuda_graph_plan, "
                                        "choose_cuda_graph_variant"):
        CudaGraphRunner(torch.nn.Identity(), _torch_native(HalfDone), 4, 2, "cpu")


def test_flashinfer_implements_every_hook_and_adds_cascade_at_large_buckets():
    from radixlm.srt.executor.attention import flashinfer_backend, flashinfer_graphs

    backend = object.__new__(flashinfer_backend.FlashInferBackend)  # no CUDA here: the class only
    assert backend.supports_cuda_graph and missing_cuda_graph_hooks(backend) == []
    backend.cascade = True
    big = flashinfer_graphs.CASCADE_GRAPH_MIN_BS
    assert backend.cuda_graph_variants(big - 1) == (DEFAULT_GRAPH_VARIANT,)
    assert backend.cuda_graph_variants(big) == (DEFAULT_GRAPH_VARIANT, flashinfer_graphs.CASCADE_GRAPH_VARIANT)
    backend.cascade = False  # --disable-cascade-attention
    assert backend.cuda_graph_variants(big) == (DEFAULT_GRAPH_VARIANT,)


def test_model_runner_asks_the_backend_and_uses_no_graphs_with_torch_native(tmp_path):
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.srt.executor.model_runner import ModelRunner
    from radixlm.srt.server_args import ServerArgs

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "vocab_size": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    loaded = load_model(str(path), load_format="dummy")
    # Graphs are not disabled: the runner must find out from the backend that they cannot be used.
    args = ServerArgs(model_path=str(path), load_format="dummy", device="cpu", disable_cuda_graph=False)
    runner = ModelRunner(loaded, args, torch.zeros(4, 64, dtype=torch.int64), num_kv_slots=256)
    assert isinstance(runner.attn_backend, TorchNativeBackend) and runner.graph_runner is None


class RecordingBackend(AttentionBackend):
    """Implements every hook and records the calls; buckets of 4 and up have a second variant,
    which batches of an odd size choose."""

    def __init__(self):
        self.calls: list[tuple] = []

    def plan(self, batch):
        self.calls.append(("plan", batch.batch_size))

    def forward(self, q, k, v, layer_id):
        raise AssertionError("not run: capture is stubbed")

    def prefers_eager(self, batch):
        self.calls.append(("prefers_eager", batch.batch_size))
        return batch.batch_size == 1

    def graph_can_replay(self, batch):
        return batch.batch_size != 5  # as if its keys overflowed the graphs' tables

    @property
    def supports_cuda_graph(self) -> bool:
        return True

    def init_cuda_graph_state(self, max_bs, max_pages_per_req):
        self.calls.append(("init", max_bs, max_pages_per_req))

    def cuda_graph_variants(self, bs):
        return (DEFAULT_GRAPH_VARIANT, "wide") if bs >= 4 else (DEFAULT_GRAPH_VARIANT,)

    def capture_cuda_graph_plan(self, variant, bs, out_cache_loc):
        assert out_cache_loc.shape == (bs,)
        self.calls.append(("capture", variant, bs))
        return f"{variant}-{bs}"

    def choose_cuda_graph_variant(self, batch, bs):
        return "wide" if batch.batch_size % 2 else DEFAULT_GRAPH_VARIANT

    def replay_cuda_graph_plan(self, variant, handle, batch, bs, out_cache_loc):
        assert handle == f"{variant}-{bs}"
        self.calls.append(("replay", variant, bs, out_cache_loc.tolist()))


class FakeGraph:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def pool(self):
        return None

    def replay(self):
        self.log.append(("graph", self.name))


def test_graph_runner_calls_the_hooks_in_the_documented_order(monkeypatch):
    backend = RecordingBackend()

    def record(runner, bs, pool, with_lora=False):  # what capture would give: the bucket's logits, a graph
        variant = backend.calls[-1][1]
        return torch.full((bs, VOCAB), float(bs)), FakeGraph(backend.calls, f"{variant}-{bs}")

    monkeypatch.setattr(CudaGraphRunner, "_record", record)
    runner = CudaGraphRunner(torch.nn.Identity(), backend, max_bs=6, max_pages_per_req=3, device="cpu")
    assert runner.buckets == [1, 2, 4, 6]
    assert backend.calls == [("init", 6, 3), ("capture", "decode", 6), ("capture", "wide", 6),
                             ("capture", "decode", 4), ("capture", "wide", 4), ("capture", "decode", 2),
                             ("capture", "decode", 1)]

    # One variant: the backend may prefer eager; with variants it chooses among them instead.
    backend.calls.clear()
    assert not runner.should_replay(_decode_batch(1)) and runner.should_replay(_decode_batch(2))
    assert runner.should_replay(_decode_batch(3)) and not runner.should_replay(_decode_batch(7))
    assert not runner.should_replay(_decode_batch(5))  # does not fit: eager though its bucket has variants
    assert backend.calls == [("prefers_eager", 1), ("prefers_eager", 2)]

    backend.calls.clear()
    logits = runner.replay(_decode_batch(3))  # padded to 4, odd: the second variant
    assert logits.shape == (3, VOCAB) and float(logits[0, 0]) == 4.0
    assert backend.calls == [("replay", "wide", 4, [10, 11, 12, cuda_graph_runner.PADDING_SLOT]), ("graph", "wide-4")]
    assert runner.input_ids[:4].tolist() == [1, 2, 3, 0] and runner.positions[:4].tolist() == [5, 5, 5, 0]

    backend.calls.clear()
    runner.replay(_decode_batch(2))  # a single-variant bucket: no choice asked
    assert backend.calls == [("replay", "decode", 2, [10, 11]), ("graph", "decode-2")]


def test_variants_must_start_with_the_default(monkeypatch):
    backend = RecordingBackend()
    backend.cuda_graph_variants = lambda bs: ("wide",)
    monkeypatch.setattr(CudaGraphRunner, "_record", lambda runner, bs, pool, with_lora=False: (None, FakeGraph([], "")))
    with pytest.raises(ValueError, match="must start with 'decode'"):
        CudaGraphRunner(torch.nn.Identity(), backend, max_bs=2, max_pages_per_req=1, device="cpu")


def test_with_lora_each_bucket_is_captured_twice_and_replay_picks_by_the_batch(monkeypatch):
    """LoRA: every (bucket, variant) is captured without and with the adapters' products; a
    batch with adapter tokens replays the second, its rows' slots copied into the runner's
    buffer (padding rows: the base model's zero row), and a base-model batch the first."""
    from radixlm.srt.lora.layers import BatchAdapters

    backend = RecordingBackend()

    def record(runner, bs, pool, with_lora=False):
        variant = backend.calls[-1][1]
        name = f"{variant}-{bs}" + ("-lora" if with_lora else "")
        return torch.full((bs, VOCAB), float(bs)), FakeGraph(backend.calls, name)

    monkeypatch.setattr(CudaGraphRunner, "_record", record)
    lora = BatchAdapters(num_slots=3, max_rank=2, device="cpu", dtype=torch.float32)
    runner = CudaGraphRunner(torch.nn.Identity(), backend, max_bs=6, max_pages_per_req=3, device="cpu", lora=lora)
    assert [c for c in backend.calls if c[0] == "capture"][:4] == [
        ("capture", "decode", 6), ("capture", "decode", 6), ("capture", "wide", 6), ("capture", "wide", 6)]
    assert set(runner.graphs[4]) == {"decode", ("decode", "lora"), "wide", ("wide", "lora")}
    assert runner.should_replay(_decode_batch(3)) and not runner.should_replay(_decode_batch(1))

    backend.calls.clear()
    batch = _decode_batch(3)
    lora.prepare([2, -1, 0])  # as the model runner does before every forward
    runner.replay(batch)  # padded to 4, odd: the second variant, with LoRA
    assert backend.calls[-1] == ("graph", "wide-4-lora")
    assert runner.adapter_rows[:4].tolist() == [2, 3, 0, 3]

    backend.calls.clear()
    lora.prepare([-1, -1])
    runner.replay(_decode_batch(2))
    assert backend.calls[-1] == ("graph", "decode-2")
