"""A DeiT-Tiny-style Vision Transformer (Dosovitskiy et al. 2020; Touvron et al. 2021).

Patches -> linear embedding + learned positions + a class token -> pre-norm
transformer blocks -> LayerNorm -> linear head on the class token.
DeiT-Tiny: width 192, depth 12, 3 heads, MLP ratio 4.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """``ViT(...)(x) -> logits``; x is (B, C, H, W) with H, W divisible by ``patch``."""

    def __init__(self, *, num_classes: int, image_size: int, patch: int, in_channels: int = 3,
                 dim: int = 192, depth: int = 12, heads: int = 3, dropout: float = 0.0):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} must be divisible by patch {patch}")
        n_patches = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, patch)  # one output pixel per patch
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(_Block(dim, heads, dropout) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def param_roles(self) -> dict[str, str]:
        """Parameter name -> ``embed`` (patches, positions, class token) | ``head`` | ``other``."""
        embed = ("patch_embed.", "cls_token", "pos_embed")
        return {
            name: "embed" if name.startswith(embed) else "head" if name.startswith("head.") else "other"
            for name, _ in self.named_parameters()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, dim)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        x = self.ln(self.blocks(x))
        return self.head(x[:, 0])


def vit_tiny(*, num_classes: int, image_size: int, in_channels: int = 3, dropout: float = 0.0) -> ViT:
    """DeiT-Tiny widths; patch 4 for images of 32 px and up, else 2."""
    patch = 4 if image_size >= 32 and image_size % 4 == 0 else 2
    return ViT(num_classes=num_classes, image_size=image_size, patch=patch, in_channels=in_channels,
               dropout=dropout)

