"""The attention-backend interface: plan once per batch, then run every layer over the paged pool."""

from __future__ import annotations

import abc

import torch

from radixlm.srt.executor.forward_batch import ForwardBatch


class AttentionBackend(abc.ABC):
    """Stores each layer's new K/V in the pool and attends over prefix + new tokens.

    `plan` is called once per forward with the batch metadata; `forward` then runs for every
    layer and must not depend on anything but the plan, the pool and its arguments.
    """

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        """True when this batch should be planned and run eagerly even though a CUDA graph could
        replay it (an attention plan the graph does not hold, such as cascade, is worth more)."""
        return False

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
