"""Runs a check script under Triton's CPU interpreter (TRITON_INTERPRET=1) in a fresh process,
so that kernels are checked numerically without a GPU; skips where Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Triton 3.6's interpreter turns a one-element array into a Python int (a loop bound taken from
# program_id or a load) with int(), which NumPy >= 2.4 refuses for arrays with a dimension
# ("only 0-dimensional arrays can be converted"); .item() is what it means.
_INDEX_SHIM = """
import triton.runtime.interpreter as _interpreter
if hasattr(_interpreter, "_patch_lang_tensor"):
    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_with_item_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interpreter._patch_lang_tensor = _patch_with_item_index
"""


def run_in_interpreter(script: str, timeout: float = 300) -> str:
    """The last line `script` prints; fails the test with its stderr if it exits non-zero."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INDEX_SHIM + script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]
