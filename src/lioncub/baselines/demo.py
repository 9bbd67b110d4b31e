r"""DeMo, decoupled momentum optimization (arXiv 2411.19870), written here from the paper's description.

Every step, on every rank, with its own gradient ``g_i``::

    m_i ← β·m_i + g_i                                  # momentum, local (never averaged)
    C_i = DCT(chunks of m_i)                           # orthonormal DCT-II per chunk
    S_i = top-k of C_i per chunk (by |value|)          # the fast-moving components
    m_i ← m_i - IDCT(S_i)                              # they leave the local momentum
    S   = mean_i S_i                                   # all_gather of (index, value) pairs
    θ   ← θ·(1 - lr·wd) - lr·sign(IDCT(S))             # same update on every rank

Chunks: every parameter tensor, flattened, is cut into rows of ``chunk`` elements (the last
row zero-padded; the padding's share of an inverse transform is dropped). The DCT is the
orthonormal DCT-II matrix ``D[j, t] = sqrt(2/c)·a_j·cos(π(2t+1)j / 2c)`` (``a_0 = 1/√2``,
else 1), built here in float64 and used in fp32: a row's coefficients are ``x @ D.T``, the
inverse ``C @ D``. (The paper cuts matrices into 2-D blocks; this is the 1-D form.)

On the wire, per rank per step, one ``uint8`` message through ``all_gather``: ``k`` fp32
values and ``k`` uint8 indices per row; with the defaults (``k=4``, ``chunk=64``)
``4·(32 + 8) / 64 = 2.5`` bits per element per step. Defaults ``beta=0.999`` (the
paper's), decoupled weight decay as in AdamW. Replicas stay identical after every step.

Devices: the DCT matrix, the momenta and every message live on the parameters' device
(:func:`lioncub.comm.device_of`; the matrix is built on the CPU in float64 and moved, so it
is the same on every device); the message travels through :func:`lioncub.comm.all_gather`.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .. import comm
from .base import Adapter, broadcast_module
from ..validate import check_int
from .wire import Packer, Reader, all_gather_bytes, check_config, check_float, rows, unrows

__all__ = ["DeMo", "dct_matrix"]


def dct_matrix(c: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``c`` (rows: frequencies): ``D @ D.T = I``, on ``device``
    (default CPU). Built on the CPU in float64 and cast there, so its values do not depend on ``device``."""
    j = torch.arange(c, dtype=torch.float64).view(-1, 1)
    t = torch.arange(c, dtype=torch.float64).view(1, -1)
    d = math.sqrt(2.0 / c) * torch.cos(math.pi * (2 * t + 1) * j / (2 * c))
    d[0] /= math.sqrt(2.0)
    return d.to(dtype).to(device if device is not None else "cpu")


class DeMo(Adapter):
    """Decoupled momentum, DCT top-``k`` per chunk exchanged, sign of the mean applied (module doc).

    :meth:`state_dict` keeps the momenta and the step count. ``sent_bytes``: the bytes this
    rank has put on the wire; ``last_message``: its latest message (for tests).
    """

    family = "lion"

    def __init__(self, module: nn.Module, *, lr: float, k: int = 4, chunk: int = 64, beta: float = 0.999,
                 group=None, weight_decay: float = 0.0):
        super().__init__(module, group=group)
        self.chunk = check_int("chunk", chunk, 1, 256, what="DCT length; indices travel as uint8")
        self.k = check_int("k", k, 1, chunk, what="DCT components sent per chunk")
        self.beta = check_float("beta", beta, 0.0, 1.0, "momentum decay")
        self.weight_decay = check_float("weight_decay", weight_decay, 0.0, math.inf, "decoupled", high_open=True)
        self.name = "demo"
        broadcast_module(module, group)
        self.params = list(module.parameters())
        self.device = comm.device_of(self.params)
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.dct = dct_matrix(self.chunk, device=self.device)
        self.sent_bytes, self.last_message = 0, None

    @torch.no_grad()
    def step(self, lr: float) -> bool:
        packer = Packer(self.device)
        for p, m in zip(self.params, self.momentum):
            m.mul_(self.beta)
            if p.grad is not None:
                m.add_(p.grad)
            coef = rows(m.reshape(-1), self.chunk) @ self.dct.T
            _, idx = coef.abs().topk(self.k, dim=1)
            val = torch.gather(coef, 1, idx)
            m.sub_(unrows(torch.zeros_like(coef).scatter_(1, idx, val) @ self.dct, m.numel()).view_as(m))
            packer.add(val)
            packer.add(idx.to(torch.uint8))
        self.last_message = msg = packer.message()
        self.sent_bytes += msg.numel()
        readers = [Reader(msg) for msg in all_gather_bytes(msg, self.group, self.world)]
        for p in self.params:
            nrows = math.ceil(p.numel() / self.chunk)
            total = torch.zeros(nrows, self.chunk, device=self.device)
            for reader in readers:  # rank order: the same sum on every rank; a rank's indices are distinct
                val = reader.take(torch.float32, nrows * self.k).view(nrows, self.k)
                total.scatter_add_(1, reader.take(torch.uint8, nrows * self.k).view(nrows, self.k).long(), val)
            update = unrows((total / self.world) @ self.dct, p.numel()).view_as(p)
            if self.weight_decay:
                p.mul_(1 - lr * self.weight_decay)
            p.add_(update.sign_(), alpha=-lr)
            p.grad = None
        self.steps += 1
        return True

    # ------------------------------------------------------------------ state
    def _config(self) -> dict:
        return dict(k=self.k, chunk=self.chunk, beta=self.beta, world=self.world)

    def state_dict(self) -> dict:
        return copy.deepcopy(dict(config=self._config(), steps=self.steps, sent_bytes=self.sent_bytes,
                                  momentum=self.momentum))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        check_config(state_dict["config"], self._config())
        self.steps, self.sent_bytes = int(state_dict["steps"]), int(state_dict["sent_bytes"])
        for m, saved in zip(self.momentum, state_dict["momentum"]):
            m.copy_(saved)
