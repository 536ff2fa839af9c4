"""What loading a model tells its user (issue 31): a server's first start converts the default
model's GGUF once and says so, each load says how many tensors and MiB it holds, and a load of
the config and tokenizer alone says that instead of "0 tensors, 0 MiB"."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import torch

from radixlm.srt.executor import gguf_loader, model_loader
from radixlm.srt.executor.model_loader import load_model, weight_shapes

_LOAD_RE = re.compile(r"(\d+) tensors, (\d+) MiB in (\S+) on (\S+)")


def _mib(weights) -> int:
    return round(sum(t.numel() * t.element_size() for t in weights.values()) / 2**20)


def _load_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == model_loader.logger.name]


@pytest.fixture()
def load_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=model_loader.logger.name)
    return caplog


def test_a_first_load_converts_once_and_both_lines_count_the_same_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        load_log: pytest.LogCaptureFixture) -> None:
    """The cold path of a newcomer's first start, into an empty cache (~20 s on 2 cores)."""
    monkeypatch.setenv(gguf_loader.CACHE_DIR_ENV, str(tmp_path / "cache"))
    loaded = load_model()
    stages = capsys.readouterr().err.splitlines()
    gguf_name = Path(loaded.model_path).name
    assert stages[0] == (f"[radixlm] converting {gguf_name} into {loaded.local_dir} (once; later loads read that "
                         "copy): reading its metadata"), stages
    converted = [line for line in stages if line.startswith(f"[radixlm] converted {gguf_name} in ")]
    assert len(converted) == 1, stages
    assert converted[0].endswith(f": {len(loaded.weights)} tensors, {_mib(loaded.weights)} MiB in float32")
    (line,) = _load_lines(load_log)
    assert line.startswith(f"loaded the weights of {loaded.model_path} from {loaded.local_dir} in "), line
    assert line.endswith(f"s: {len(loaded.weights)} tensors, {_mib(loaded.weights)} MiB in torch.float32 on cpu")

    load_log.clear()
    again = load_model()
    assert capsys.readouterr().err == ""  # read from the copy: nothing to announce
    assert _LOAD_RE.search(_load_lines(load_log)[0]).groups() == (
        str(len(again.weights)), str(_mib(again.weights)), "torch.float32", "cpu")


def test_each_load_says_what_it_holds(load_log: pytest.LogCaptureFixture) -> None:
    loaded = load_model(dtype=torch.bfloat16)
    (line,) = _load_lines(load_log)
    assert _LOAD_RE.search(line).groups() == (str(len(loaded.weights)), str(_mib(loaded.weights)),
                                              "torch.bfloat16", "cpu"), line
    assert len(loaded.weights) == 272 and _mib(loaded.weights) == 257  # SmolLM2-135M, tied embeddings


def test_a_load_without_weights_says_so_instead_of_zero_tensors(load_log: pytest.LogCaptureFixture) -> None:
    meta = load_model(with_weights=False)
    (line,) = _load_lines(load_log)
    assert line.startswith(f"read the config and tokenizer of {meta.model_path} in "), line
    assert line.endswith("s (not its weights)"), line
    assert "tensors" not in line and "MiB" not in line


def test_a_tensor_parallel_rank_counts_its_own_part(load_log: pytest.LogCaptureFixture) -> None:
    whole = load_model(load_format="dummy")
    rank = load_model(load_format="dummy", tensor_parallel=(1, 2))
    whole_line, rank_line = _load_lines(load_log)
    whole_mib = round(sum(math.prod(shape) for shape in weight_shapes(whole.config).values()) * 4 / 2**20)
    assert _LOAD_RE.search(whole_line).groups()[:2] == ("272", str(whole_mib)), whole_line
    assert "made random weights" in whole_line and "tensor-parallel" not in whole_line
    held = {name: rank.weights[name] for name in rank.weights}  # made (and cut) when read
    assert _LOAD_RE.search(rank_line).groups()[:2] == (str(len(held)), str(_mib(held))), rank_line
    assert "tensor-parallel rank 1 of 2" in rank_line and _mib(held) < whole_mib
