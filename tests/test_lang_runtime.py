"""Runtime: starts `radixlm serve` as a child process, serves a program, and stops cleanly."""

from __future__ import annotations

import pytest

import radixlm as sgl
from benchmarks.harness import pid_alive


def test_runtime_rejects_unknown_server_arguments():
    with pytest.raises(TypeError, match="max_total_token"):
        sgl.Runtime(max_total_token=100)  # a typo must not start a server (nor pass as a prefix)


@pytest.mark.slow
def test_runtime_serves_a_program_and_shuts_down():
    runtime = sgl.Runtime(max_total_tokens=4096, max_running_requests=8)
    pid = runtime._proc.pid
    try:
        assert runtime.endpoint.get_model_info()["model_path"].endswith(".gguf")

        @sgl.function
        def prog(s):
            s += "The capital of France is" + sgl.gen("city", max_tokens=3)

        state = prog.run(backend=runtime, temperature=0)
        assert state["city"].strip().startswith("Paris")
        assert runtime.flush_cache() is True
    finally:
        runtime.shutdown()
    assert not pid_alive(pid)
    runtime.shutdown()  # idempotent
