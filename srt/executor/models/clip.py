"""CLIP's vision transformer, as LLaVA uses it: patches + CLS with learned positions, a
pre-norm, then bidirectional pre-norm layers; no post-norm or pooling (LLaVA reads a hidden
state). Runs a batch of same-size images at once, on the model's device, outside CUDA graphs.

Module names follow the Hugging Face checkpoint (`embeddings.*`, `encoder.layers.N.*`), so its
tensors load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...configs import VisionConfig
from .layers import Embedding, Linear


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


class ClipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        hidden = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size, config.patch_size, bias=False)
        self.position_embedding = Embedding((config.image_size // config.patch_size) ** 2 + 1, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, 1 + patches, hidden]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.num_heads, -1).transpose(1, 2)

        # Every token of an image attends to every other (no mask): SDPA's default scale is head_dim ** -0.5.
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class ClipMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(config) for _ in range(config.num_layers))


class ClipVisionTower(nn.Module):
    """Only the layers up to the feature layer LLaVA reads are built (config.num_layers)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # HF's spelling
        self.encoder = ClipEncoder(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The feature layer's hidden states, CLS first: [B, 1 + patches, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x
