"""Shared fixtures: one Engine, one HF reference model and one server on the embedded default
model; every server a test starts writes under this session's temporary directory."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from benchmarks.harness import ServerProcess


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def servers_write_under_pytest_tmp(tmp_path_factory):
    """Each server keeps its log and its TMPDIR (so its private ipc directory too) in a folder
    of its own under pytest's temporary directory, which pytest prunes; so does everything else
    the tests start or write through tempfile (a Runtime's log, an Engine's ranks, processes
    started by hand): nothing is left in /tmp."""
    ServerProcess.temp_root = tmp_path_factory.mktemp("servers")
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield
    ServerProcess.temp_root = None
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def default_model():
    from radixlm.srt.executor.model_loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def engine():
    from radixlm.srt import Engine

    eng = Engine(max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(default_model):
    """Hugging Face transformers' own Llama on the same weights: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model.local_dir, dtype=torch.float32)
    return model.eval()


# A chat template that opens the think block at the generation prompt, as Qwen3's does.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% endif %}")


@pytest.fixture(scope="session")
def thinking_server(tmp_path_factory):
    """A real server with THINKING_TEMPLATE and --reasoning-parser qwen3, shared by the tests of
    reasoning output (one start instead of one per file)."""
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = ServerProcess("--max-total-tokens", "8192", "--reasoning-parser", "qwen3", "--chat-template", str(template))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server():
    """A real `radixlm serve` on the default model (no API key), shared by the integration tests."""
    srv = ServerProcess("--max-total-tokens", "16384")
    yield srv
    srv.stop()
