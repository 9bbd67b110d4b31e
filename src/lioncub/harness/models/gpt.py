"""A small GPT (decoder-only transformer), nanoGPT-style.

Pre-norm blocks: x = x + attn(ln(x)); x = x + mlp(ln(x)); causal
self-attention through ``scaled_dot_product_attention``; learned positions;
optional input/output embedding tying. Sizes run from a CPU toy to GPT-2 1.5B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class GPTConfig:
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block."""
    n_embd: int
    """Residual width (divisible by ``n_head``)."""
    vocab_size: int = 50304
    """Token ids are in [0, vocab_size)."""
    block_size: int = 1024
    """Longest context (size of the position table)."""
    dropout: float = 0.0
    """Dropout after attention/MLP and on embeddings."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tied_embeddings: bool = True
    """Output head shares the token embedding matrix."""


# name -> (n_layer, n_head, n_embd); GPT-2 sizes as published.
GPT_SIZES = {
    "gpt-tiny": (2, 4, 64),
    "gpt-mini": (4, 4, 128),
    "gpt2-124m": (12, 12, 768),
    "gpt2-350m": (24, 16, 1024),
    "gpt2-774m": (36, 20, 1280),
    "gpt2-1.5b": (48, 25, 1600),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # back to (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg)(idx, targets) -> (logits, loss)``; idx is (B, T) token ids."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def param_roles(self) -> dict[str, str]:
        """Parameter name -> ``embed`` | ``head`` | ``other`` (for per-group learning rates)."""
        roles = {}
        for name, _ in self.named_parameters():  # a tied head is listed once, as wte
            roles[name] = "embed" if name.startswith(("wte.", "wpe.")) else "head" if name.startswith("head.") else "other"
        return roles

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def build_gpt(name: str, *, vocab_size: int, block_size: int, dropout: float = 0.0,
              tied_embeddings: bool = True) -> GPT:
    """A GPT of a named size (``GPT_SIZES``)."""
    if name not in GPT_SIZES:
        raise ValueError(f"model must be one of {', '.join(GPT_SIZES)}; got {name!r}")
    n_layer, n_head, n_embd = GPT_SIZES[name]
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                    block_size=block_size, dropout=dropout, tied_embeddings=tied_embeddings)
    return GPT(cfg)
