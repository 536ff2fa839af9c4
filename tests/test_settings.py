"""Settings: sections that each component reads, a command line generated from their fields,
and bad values refused in one line before anything loads."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from radixlm.srt.server_args import REASONING_PARSERS, SECTIONS, TOOL_CALL_PARSERS, ServerArgs
from radixlm.srt.server_flags import build_parser, parse_flags, to_flags

SERVE = [sys.executable, "-m", "radixlm.srt.launch"]


def test_every_setting_is_a_flag_and_every_flag_a_setting():
    fields = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert len(fields) == len(set(fields)), "a flat name belongs to one section"
    flags = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert flags == set(fields)
    assert all(f.metadata["help"] for section in SECTIONS.values() for f in dataclasses.fields(section))


def test_flat_names_reach_their_sections_and_round_trip():
    args = ServerArgs(max_total_tokens=4096, page_size=4, tp_all_reduce="one_shot", speculative_algorithm="NGRAM",
                      served_model_name="m", disable_pdl=True)
    assert args.cache.max_total_tokens == 4096 and args.cache.page_size == 4
    assert args.parallel.tp_all_reduce == "one_shot" and args.speculative.speculative_algorithm == "ngram"
    assert args.api.served_model_name == "m" and args.executor.disable_pdl
    assert ServerArgs(**args.to_dict()) == args
    assert parse_flags(to_flags(args.changed())) == args
    assert args.replace(page_size=1).cache.page_size == 1 and args.cache.page_size == 4
    with pytest.raises(AttributeError):
        args.cache = None


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="fp64"), "dtype: must be one of auto, float32, bfloat16, float16"),
    (dict(max_total_tokens=-5), "max_total_tokens: must be >= 1"),
    (dict(port=99999), "port: must be between 1 and 65535"),
    (dict(mem_fraction_static=1.0), "mem_fraction_static: must be between 0.0 and 1.0"),
    (dict(max_running_requests=2.5), "max_running_requests: must be an integer"),
    (dict(schedule_policy="random"), "schedule_policy: must be one of lpm, fcfs"),
    (dict(device="tpu"), "device: must be auto, cpu, cuda or cuda:N"),
    (dict(model_path="/no/such/model"), "model_path: no file or directory at '/no/such/model'"),
    (dict(max_totl_tokens=5), "unknown server argument.*max_totl_tokens"),
])
def test_bad_values_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_the_parsers_named_in_the_settings_are_the_ones_that_exist():
    from radixlm.srt.server.tool_calls.parsers import PARSERS
    from radixlm.srt.server.tool_calls.reasoning import PARSERS as REASONING

    assert set(TOOL_CALL_PARSERS) == set(PARSERS) and set(REASONING_PARSERS) == set(REASONING)


@pytest.mark.parametrize("flags, error", [
    (["--dtype", "fp64"], "argument --dtype: must be one of auto, float32, bfloat16, float16 (got 'fp64')"),
    (["--max-total-tokens", "-5"], "argument --max-total-tokens: must be >= 1"),
    (["--port", "99999"], "argument --port: must be between 1 and 65535"),
    (["--model-path", "/no/such/model"], "model_path: no file or directory at '/no/such/model'"),
    (["--speculative-algorithm", "draft"], "speculative_draft_model_path: required"),
])
def test_a_bad_flag_is_one_line_before_anything_loads(flags, error):
    started = time.monotonic()
    proc = subprocess.run(SERVE + flags, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    usage, message = proc.stderr.strip().splitlines()
    assert usage == "usage: radixlm serve [--model-path PATH] [--port N] [...]"
    assert message.startswith(f"radixlm serve: error: {error}")
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr
    assert time.monotonic() - started < 60  # nothing was loaded


def test_the_api_key_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("RADIXLM_API_KEY", "from-env")
    assert parse_flags([]).http.api_key == "from-env"
    assert parse_flags(["--api-key", "given"]).http.api_key == "given"
    assert "RADIXLM_API_KEY" in build_parser().format_help()
