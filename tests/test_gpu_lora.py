"""LoRA on CUDA: the CPU suite's checks (test_lora.py) on the GPU path, float32 so that HF +
PEFT on the host is the reference at the CPU's tolerance, with overlap scheduling on (a slot's
copy is queued behind the step still running), the Triton kernels (--lora-backend auto on CUDA)
and decode replayed from CUDA graphs (each bucket captured with and without the adapters'
products); then the torch backend on CUDA. Written without a GPU to run it on (none was
lent in the session that built LoRA serving): the first device session runs this file."""

from __future__ import annotations

import pytest

from test_lora import GREEDY, LOGPROB_TOL, _ours, make_adapter
from test_model_families import PROMPTS, _build, _hf_greedy, _hf_logprobs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.srt.executor.model_loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_adapters_on_cuda_match_hf_peft_and_mix_in_one_batch(backend, tokenizer, tmp_path):
    from radixlm.srt import Engine

    base = _build("llama", tokenizer, tmp_path / "base")
    refs = {None: base,
            "all": make_adapter(base, tmp_path / "all", 1, r=8, lora_alpha=16, target_modules="all-linear"),
            "qv": make_adapter(base, tmp_path / "qv", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               use_rslora=True)}
    engine = Engine(model_path=str(tmp_path / "base"), device="cuda", dtype="float32", max_total_tokens=4096,
                    enable_lora=True, lora_paths=[f"{n}={tmp_path / n}" for n in ("all", "qv")],
                    max_loras_per_batch=1, lora_backend=backend)
    try:
        ids = tokenizer.encode(PROMPTS[0])
        names = ["all", None, "qv", "all"]  # one slot: the adapters take turns on it
        outs = engine.generate(input_ids=[ids] * len(names), sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0, lora_path=names)
        for name, out in zip(names, outs):
            assert (_ours(out) - _hf_logprobs(refs[name], ids)).abs().max().item() <= LOGPROB_TOL, name
            assert out["output_ids"] == _hf_greedy(refs[name], ids), name
        # Base-model requests alone replay the graphs without the adapters' products.
        alone = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert alone["output_ids"] == _hf_greedy(base, ids)
        info = engine.scheduler.server_info()
        assert info["kv"]["leaked"] == 0 and info["lora"]["pinned_slots"] == 0
        runner = engine.scheduler.engine.runner
        assert runner.device.type == "cuda" and runner.graph_runner is not None
        assert any(isinstance(key, tuple) for key in runner.graph_runner.graphs[1])
        assert runner.lora.batch.triton == (backend == "auto")
    finally:
        engine.shutdown()
