"""Inputs the fused-loop and Triton kernel tests share (no pytest here: tests/gpu/kernel_runner.py imports it)."""
from __future__ import annotations

import torch


def kernel_tensors(sizes, seed):
    """(momenta, gradients) of ``sizes``, with exact zeros of c (m = g = 0) and -0.0 (β1·(-0) + α·(-0))."""
    g = torch.Generator().manual_seed(seed)
    ms = [torch.randn(n, generator=g) for n in sizes]
    gs = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    for m, gr in zip(ms, gs):
        m[::5] = 0.0
        gr[::5] = 0.0
        m[1::7] = -0.0
        gr[1::7] = -0.0
    return ms, gs
