"""ResNet-18/50 with the CIFAR-style stem (3x3 conv, stride 1, no max-pool).

He et al. 2015; the CIFAR stem keeps small images (32x32, or 8x8 digits)
from being down-sampled away before the first stage.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.shortcut = _shortcut(in_ch, ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        out_ch = ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.conv3 = nn.Conv2d(ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


class ResNet(nn.Module):
    """``ResNet(block, layers, num_classes, in_channels)(x) -> logits``; x is (B, C, H, W)."""

    def __init__(self, block, layers: list[int], *, num_classes: int, in_channels: int = 3, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages, in_ch = [], width
        for i, n_blocks in enumerate(layers):
            ch, stride = width * 2**i, 1 if i == 0 else 2
            for j in range(n_blocks):
                stages.append(block(in_ch, ch, stride if j == 0 else 1))
                in_ch = ch * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_ch, num_classes)

    def param_roles(self) -> dict[str, str]:
        """Parameter name -> ``embed`` (stem) | ``head`` | ``other``."""
        return {
            name: "embed" if name.startswith("stem.") else "head" if name.startswith("head.") else "other"
            for name, _ in self.named_parameters()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, C', H', W')
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(*, num_classes: int, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, in_channels=in_channels, width=width)


def resnet50(*, num_classes: int, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, in_channels=in_channels, width=width)
