"""What each layer's attention computes beyond causal softmax(q k^T * scale) v, and which
backends can compute it.

A backend lists the features it implements in `SUPPORTED_FEATURES` (a class attribute); the
model runner refuses, by name, a model whose layers need one it lacks. Nothing runs a model
approximately (a sliding window ignored changes every token past the window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SLIDING_WINDOW = "sliding_window"
LOGIT_SOFTCAP = "logit_softcap"


@dataclass(frozen=True)
class LayerAttention:
    # The query attends to the last `sliding_window` positions, its own included (HF's
    # convention: key position > query position - sliding_window). None: all of them.
    sliding_window: int | None = None
    # Scores become cap * tanh(scores / cap) after scaling, before masking (Gemma 2).
    logit_softcap: float | None = None

    @property
    def window_left(self) -> int:
        """FlashInfer's `window_left`: keys at most this far left of the query; -1 for none."""
        return -1 if self.sliding_window is None else self.sliding_window - 1


def layer_specs(windows: Sequence[int | None], num_layers: int, logit_softcap: float | None,
                max_context_len: int) -> list[LayerAttention]:
    """One spec per layer. A window that covers the whole context is no window at all: such
    layers run as full attention (which backends without window support can run too)."""
    specs = []
    for layer in range(num_layers):
        window = windows[layer] if windows else None
        if window is not None and window >= max_context_len:
            window = None
        specs.append(LayerAttention(window, logit_softcap))
    return specs


def required_features(layers: Sequence[LayerAttention]) -> set[str]:
    needed = set()
    if any(spec.sliding_window is not None for spec in layers):
        needed.add(SLIDING_WINDOW)
    if any(spec.logit_softcap is not None for spec in layers):
        needed.add(LOGIT_SOFTCAP)
    return needed


def check_backend_supports(backend_cls: type, layers: Sequence[LayerAttention], model_name: str) -> None:
    """Raises ValueError naming the backend, the model and each feature the backend lacks."""
    supported = getattr(backend_cls, "SUPPORTED_FEATURES", frozenset())
    missing = sorted(required_features(layers) - set(supported))
    if missing:
        raise ValueError(f"attention backend {backend_cls.__name__} does not support {', '.join(missing)}, "
                         f"which {model_name} needs; use --attention-backend torch_native")
