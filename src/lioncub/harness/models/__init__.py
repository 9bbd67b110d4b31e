"""Models for the training harness (never imported by ``lioncub`` itself).

``build_model(config, data_info)`` builds the named model; ``param_groups``
splits its parameters into optimizer groups by role (embeddings / head /
other) so each can have its own learning rate.
"""
from __future__ import annotations

import torch.nn as nn

from .gpt import GPT, GPT_SIZES, GPTConfig, build_gpt
from .resnet import ResNet, resnet18, resnet50
from .vit import ViT, vit_tiny

__all__ = ["GPT", "GPTConfig", "GPT_SIZES", "ResNet", "ViT", "build_model", "param_groups"]


def build_model(config, data_info: dict) -> nn.Module:
    """The model ``config.model`` sized for ``data_info`` (vocab_size, or num_classes/channels/image_size)."""
    if config.is_gpt:
        return build_gpt(config.model, vocab_size=config.vocab_size or data_info["vocab_size"],
                         block_size=config.block_size, dropout=config.dropout,
                         tied_embeddings=config.tied_embeddings)
    kwargs = dict(num_classes=data_info["num_classes"], in_channels=data_info["channels"])
    if config.model == "resnet18":
        return resnet18(width=config.width, **kwargs)
    if config.model == "resnet50":
        return resnet50(width=config.width, **kwargs)
    if config.model == "vit-tiny":
        return vit_tiny(image_size=data_info["image_size"], dropout=config.dropout, **kwargs)
    raise ValueError(f"unknown model {config.model!r}")


def param_groups(model: nn.Module, *, lr: float, weight_decay: float,
                 lr_embed: float | None = None, lr_head: float | None = None) -> list[dict]:
    """Optimizer groups ``{params, lr, weight_decay, role}`` by parameter role.

    Roles come from ``model.param_roles()``: ``embed`` uses ``lr_embed``, ``head``
    ``lr_head``, the rest ``lr`` (None falls back to ``lr``). Matrices (dim >= 2)
    of the ``other`` role get weight decay; biases, norms, embeddings and the head none.
    """
    roles = model.param_roles()
    lrs = {"embed": lr_embed or lr, "head": lr_head or lr, "other": lr}
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = roles[name]
        decay = role == "other" and p.dim() >= 2
        groups.setdefault((role, decay), []).append(p)
    return [
        {"params": params, "lr": lrs[role], "weight_decay": weight_decay if decay else 0.0,
         "role": role + ("" if decay else "-nodecay" if role == "other" else "")}
        for (role, decay), params in sorted(groups.items())
    ]
