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
                 dtype: torch.dtype, device: str | torch.device, k_scale: float = 1.0, v_scale: float = 1.0,
                 pdl: bool = True):
        """dtype: the model dtype, or torch.float8_e4m3fn (--kv-cache-dtype fp8_e4m3): K and V are
        then stored as k / k_scale and v / v_scale, saturated to +-448, and read back times the scale.
        pdl: our kernels that store and read the pool launch with PDL where the GPU has it."""
        shape = (num_kv_heads, num_slots, head_dim)
        self.dtype = dtype
        self.is_fp8 = dtype == FP8_KV_DTYPE
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.pdl = pdl
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # On CUDA one Triton launch stores K and V from their strided views (no transpose copies).
        self._triton_store = torch.device(device).type == "cuda" and not head_dim & (head_dim - 1) and _has_triton()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the T tokens at `slots`."""
        dtype = self.k_buffers[layer_id].dtype
        if self.is_fp8:
            self._store_fp8(layer_id, slots, k, v)
            return
        if self._triton_store and k.dtype == dtype and v.dtype == dtype:
            from .models.triton_ops import store_kv

            store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], slots, k, v, pdl=self.pdl)
            return
        # index_copy_ is much faster than advanced-index assignment on CPU.
        self.k_buffers[layer_id].index_copy_(1, slots, k.transpose(0, 1).to(dtype))
        self.v_buffers[layer_id].index_copy_(1, slots, v.transpose(0, 1).to(dtype))

    def _store_fp8(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if self._triton_store:  # quantize and scatter in one launch
            from .quantization.fp8_triton import store_kv_fp8

            store_kv_fp8(k_buf, v_buf, slots, k, v, self.k_scale, self.v_scale, pdl=self.pdl)
            return
        # Byte views: index_copy_ has no float8 kernel on CPU.
        k_buf.view(torch.uint8).index_copy_(1, slots, to_fp8(k, self.k_scale).transpose(0, 1).view(torch.uint8))
        v_buf.view(torch.uint8).index_copy_(1, slots, to_fp8(v, self.v_scale).transpose(0, 1).view(torch.uint8))

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether rotate_and_store can take these q, k, v (CUDA, Triton, KV heads dividing the
        query heads, k and v in the pool's dtype unless it is FP8)."""
        return (self._triton_store and q.shape[1] % k.shape[1] == 0
                and (self.is_fp8 or k.dtype == v.dtype == self.dtype))

    def rotate_and_store(self, layer_id: int, slots: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
        """Rotates q and k in place (rotate-half, the caches' rows at `positions`) and stores k and
        v at `slots`, in one launch (triton_ops.rotary_store_kv); see fuses_rotary."""
        from .models.triton_ops import rotary_store_kv

        rotary_store_kv(positions, q, k, v, cos_cache, sin_cache, self.k_buffers[layer_id], self.v_buffers[layer_id],
                        slots, self.k_scale, self.v_scale, pdl=self.pdl)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_KV_DTYPE).max


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype: the model's (auto) or float8_e4m3fn (fp8_e4m3)."""
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8_e4m3" else model_dtype


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated (a plain cast turns values past 448 into NaN)."""
    x = x.float() if scale == 1.0 else x.float() / scale
    return x.clamp(-_FP8_MAX, _FP8_MAX).to(FP8_KV_DTYPE)


def read_kv(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """buf[:, slots] in `dtype`: an FP8 pool's values are cast up and multiplied by its scale."""
    if buf.dtype != FP8_KV_DTYPE:
        out = _gather_slots(buf, slots)
        return out if out.dtype == dtype else out.to(dtype)
    out = _gather_slots(buf.view(torch.uint8), slots).view(FP8_KV_DTYPE).to(dtype)  # no float8 gather on CPU
    return out if scale == 1.0 else out * scale


def _gather_slots(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[:, slots] for a [heads, slots, dim] pool. On CPU one row gather per head: torch's
    index_select along dim 1 takes a slow path for float32 (3-8x slower than along dim 0 on a
    2-core x86 box; a third of a decode step at batch 16)."""
    if buf.device.type != "cpu":
        return buf.index_select(1, slots)
    out = buf.new_empty(buf.shape[0], slots.numel(), *buf.shape[2:])
    for head in range(buf.shape[0]):
        torch.index_select(buf[head], 0, slots, out=out[head])
    return out


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
