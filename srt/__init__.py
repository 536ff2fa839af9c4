"""The serving runtime: Engine (in-process) today; the server process tree builds on it."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerArgs", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: `import radixlm.srt` stays cheap for clients that never load torch.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "ServerArgs":
        from .server_args import ServerArgs

        return ServerArgs
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
