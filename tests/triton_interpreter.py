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

# The interpreter's tl.dot is np.matmul, whose BLAS picks another summation for one row than for
# several (on the 2026-12 CI machine's OpenBLAS a row's bits differed between M = 1 and M >= 2),
# where a GPU's MMA gives each row the same bits whatever the tile's height. A check of
# row-invariance prepends this, so that it tests our kernels' masking and tables, not NumPy:
# each row is multiplied on its own.
ROW_BY_ROW_DOT = """
import numpy as _np
import triton.runtime.interpreter as _interp
_create_dot = _interp.InterpreterBuilder.create_dot

def _row_by_row_dot(self, a, b, d, *args):
    rows = [_create_dot(self, _interp.TensorHandle(a.data[..., i:i + 1, :], a.dtype), b,
                        _interp.TensorHandle(d.data[..., i:i + 1, :], d.dtype), *args).data
            for i in range(a.data.shape[-2])]
    return _interp.TensorHandle(_np.concatenate(rows, axis=-2), d.dtype)

_interp.InterpreterBuilder.create_dot = _row_by_row_dot
"""


def run_in_interpreter(script: str, timeout: float = 300) -> str:
    """The last line `script` prints; fails the test with its stderr if it exits non-zero."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INDEX_SHIM + script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]
