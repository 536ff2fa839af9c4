"""The device's KV memory: per-layer K and V buffers that token slots index into.

Which request owns which slot is the scheduler's business (srt/scheduler/kv_memory.py).
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers, head-major: [num_kv_heads, num_slots, head_dim].

    Head-major keeps each head's gathered keys contiguous per token, so attention reads the
    gather directly instead of copying it into a second layout (7x faster decode attention
    on CPU than token-major plus a transpose copy).
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        shape = (num_kv_heads, num_slots, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # On CUDA one Triton launch stores K and V from their strided views (no transpose copies).
        self._triton_store = torch.device(device).type == "cuda" and not head_dim & (head_dim - 1) and _has_triton()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the T tokens at `slots`."""
        dtype = self.k_buffers[layer_id].dtype
        if self._triton_store and k.dtype == dtype and v.dtype == dtype:
            from radixlm.srt.executor.models.triton_ops import store_kv

            store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], slots, k, v)
            return
        # index_copy_ is much faster than advanced-index assignment on CPU.
        self.k_buffers[layer_id].index_copy_(1, slots, k.transpose(0, 1).to(dtype))
        self.v_buffers[layer_id].index_copy_(1, slots, v.transpose(0, 1).to(dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
