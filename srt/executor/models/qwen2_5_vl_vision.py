"""Qwen2.5-VL vision encoder: patches of every image in a batch -> merged features for the LLM.

Input is what HF's Qwen2VLImageProcessor produces: pixel_values [num_patches, C*T*P*P] with each
image's patches in merge-block order (frame, block row, block col, row in block, col in block),
and grid_thw [num_images, 3] in patches. Most blocks attend within windows of
window_size // patch_size patches a side, the blocks in fullatt_block_indexes within each frame;
both are segments of the packed batch, so images never attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ...qwen2_5_vl_config import Qwen2_5_VisionConfig as VisionConfig
from .layers import Linear


@dataclass(frozen=True)
class VisionLayout:
    """Where each patch goes for one batch of grids (host tensors; the forward moves what it uses).

    patch_order: the permutation that puts patches window by window (merge blocks kept whole);
    block_order: the same at merge-block granularity, to put merged features back in image order;
    cu_windows / cu_frames: segment boundaries of windowed / full attention in permuted order;
    hw_positions: [num_patches, 2] (row, col) of each patch in its frame, in permuted order.
    """
    patch_order: torch.Tensor
    block_order: torch.Tensor
    cu_windows: torch.Tensor
    cu_frames: torch.Tensor
    hw_positions: torch.Tensor


def check_grids(grid_thw: torch.Tensor, num_patches: int, config: VisionConfig) -> list[tuple[int, int, int]]:
    """grid_thw as a list of (t, h, w), after checking it describes num_patches patches."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw: expected shape [num_images, 3], got {tuple(grid_thw.shape)}")
    if grid_thw.shape[0] == 0:
        raise ValueError("grid_thw: no images")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    m = config.spatial_merge_size
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(f"grid_thw[{i}]={(t, h, w)}: h and w must be positive multiples of {m}")
    total = sum(t * h * w for t, h, w in grids)
    if total != num_patches:
        raise ValueError(f"pixel_values: {num_patches} patches, but grid_thw describes {total}")
    return grids


def vision_layout(grids: list[tuple[int, int, int]], config: VisionConfig) -> VisionLayout:
    m = config.spatial_merge_size
    unit = m * m
    win = config.window_size // m // config.patch_size  # window side, in merge blocks
    block_orders, window_lens, frame_lens, positions = [], [], [], []
    block_base = 0
    for t, h, w in grids:
        bh, bw = h // m, w // m
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(bh), torch.arange(bw), indexing="ij")
        wins_h, wins_w = -(-bh // win), -(-bw // win)
        window_id = ((frame * wins_h + row // win) * wins_w + col // win).flatten()
        # A stable sort keeps row-major order inside each window.
        block_orders.append(torch.argsort(window_id, stable=True) + block_base)
        window_lens.append(torch.bincount(window_id, minlength=t * wins_h * wins_w) * unit)
        frame_lens.append(torch.full((t,), h * w))
        # Patch (row, col) in processor order: blocks row-major, then row-major inside a block.
        inner_r, inner_c = torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij")
        rows = (row.flatten()[:, None] * m + inner_r.flatten()[None, :]).flatten()
        cols = (col.flatten()[:, None] * m + inner_c.flatten()[None, :]).flatten()
        positions.append(torch.stack((rows, cols), dim=-1))
        block_base += t * bh * bw
    block_order = torch.cat(block_orders)
    patch_order = (block_order[:, None] * unit + torch.arange(unit)[None, :]).flatten()
    hw_positions = torch.cat(positions)[patch_order]

    def cumulative(lens: list[torch.Tensor]) -> torch.Tensor:
        return F.pad(torch.cat(lens).cumsum(0), (1, 0))

    return VisionLayout(patch_order=patch_order, block_order=block_order, cu_windows=cumulative(window_lens),
                        cu_frames=cumulative(frame_lens), hw_positions=hw_positions)


@dataclass(frozen=True)
class SegmentPlan:
    """Attention within contiguous segments, those of equal length batched into one SDPA call:
    no padding and no mask, so a large image never pads a batch of small windows or images.

    groups: [segments, length] token indices per distinct length (on the device);
    restore: the permutation from the groups' concatenated outputs back to token order.
    """
    groups: tuple[torch.Tensor, ...]
    restore: torch.Tensor


def segment_plan(cu_seqlens: torch.Tensor, device: torch.device) -> SegmentPlan:
    """Built on the host from host boundaries, so that no block needs a device sync."""
    starts, lens = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    groups = [starts[lens == length][:, None] + torch.arange(length)[None, :] for length in lens.unique().tolist()]
    restore = torch.argsort(torch.cat([group.flatten() for group in groups]))
    return SegmentPlan(groups=tuple(group.to(device) for group in groups), restore=restore.to(device))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """Bidirectional attention within each segment of the plan. q, k, v: [N, H, D] -> [N, H, D]."""
    outs = [F.scaled_dot_product_attention(*(x[index].transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
            for index in plan.groups]
    return torch.cat([out.flatten(0, 1) for out in outs])[plan.restore]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x_float = x.float()
    return weight * (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in float32; cos/sin: [N, D] broadcast over heads of x: [N, H, D]."""
    x_float = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x_float[..., half:], x_float[..., :half]), dim=-1)
    return (x_float * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, plan)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size)
        self.norm2 = RMSNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then an MLP over each merge block's patches concatenated."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(Linear(merged, merged), nn.GELU(), Linear(merged, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).reshape(-1, merged))


class Qwen2_5_VisionEncoder(nn.Module):
    """The `visual.*` tower of Qwen2_5_VLForConditionalGeneration, batched over images."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        # The checkpoint's Conv3d has stride == kernel, so it is a linear map of each flat patch.
        self.patch_embed = Linear(config.patch_dim, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        # Rows and columns each take half of the rotated pairs, with the same frequencies.
        half = config.head_dim // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, hw_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (hw_positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq).flatten(1)  # [N, D/2]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, C*T*P*P], grid_thw [num_images, 3] ->
        [sum(t*h*w) / merge**2, out_hidden_size], images in order, each image's tokens row-major."""
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.config.patch_dim:
            raise ValueError(f"pixel_values: expected [num_patches, {self.config.patch_dim}], "
                             f"got {tuple(pixel_values.shape)}")
        layout = vision_layout(check_grids(grid_thw.cpu(), pixel_values.shape[0], self.config), self.config)
        device = self.patch_embed.weight.device
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.patch_embed.weight.dtype))
        x = x[layout.patch_order.to(device)]
        cos, sin = self.rotary(layout.hw_positions)
        windows, frames = segment_plan(layout.cu_windows, device), segment_plan(layout.cu_frames, device)
        full = set(self.config.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in full else windows)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[layout.block_order.to(device)] = merged
        return out


def load_vision_weights(encoder: Qwen2_5_VisionEncoder, weights: dict[str, torch.Tensor]) -> None:
    """Copies the checkpoint's `visual.*` tensors (`model.visual.*` in transformers 5 saves) into the
    encoder; other names are skipped. Every parameter must be written exactly once."""
    params = dict(encoder.named_parameters())
    written: set[str] = set()
    for hf_name, tensor in weights.items():
        name = hf_name.removeprefix("model.")
        if not name.startswith("visual."):
            continue
        name = name.removeprefix("visual.")
        if name == "patch_embed.proj.weight":
            name, tensor = "patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {hf_name}: shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        if name in written:
            raise ValueError(f"weight {hf_name!r} given twice")
        with torch.no_grad():
            params[name].copy_(tensor)
        written.add(name)
    missing = sorted(set(params) - written)
    if missing:
        raise ValueError(f"missing vision weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
