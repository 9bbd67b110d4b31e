r"""SparseLoCo (arXiv 2508.15706), written here from the paper's description.

DiLoCo's rounds with a sparse, 2-bit pseudo-gradient and error feedback in place of the
fp32 all-reduce and the outer Nesterov momentum::

    θ                               # global parameters, identical on every rank
    repeat:
        θ_i ← θ; H steps of AdamW on rank i's shard                  # no communication
        e_i ← β·e_i + (θ - θ_i)                                      # error feedback, per rank
        s_i = Q(top-k of e_i per chunk)                              # what rank i sends
        e_i ← e_i - s_i                                              # what was sent leaves the buffer
        θ   ← θ - α·mean_i(s_i)                                      # outer step, same on every rank

Chunks: every parameter tensor, flattened, is cut into rows of ``chunk`` elements (a
tensor smaller than ``chunk`` is one row; the last row is zero-padded); each row keeps its
``k`` largest ``|e|`` (``k`` scaled down, at least 1, for rows shorter than ``chunk``).

Quantizer Q (2 bits per kept entry: sign, level): per row, ``s`` = the row's largest
``|e|``; an entry with ``|e| >= 0.75·s`` is sent as ``sign·s``, one with
``s/4 <= |e| < 0.75·s`` as ``sign·s/2``; an entry of the top-k below ``s/4`` is not sent
this round (its index goes out as -1 and it stays in ``e``; also every entry of an
all-zero row). Each sent value is within a factor 2 of the entry it replaces, so
``e - s_i`` is exact in fp32 (Sterbenz): the residual plus what was sent is exactly the
accumulated ``β·e + Δ``.

On the wire, per rank per round, one ``uint8`` message through ``all_gather``: per row one
fp32 scale and ``k`` int16 indices, and ``k`` 2-bit codes packed four to a byte; with the
defaults (``k=64``, ``chunk=4096``, 1.56% density) ``(32 + 64·18) / 4096 = 0.289`` bits per
element per round, ``0.289 / H`` per step. The inner AdamW moments persist across rounds (as
in DiLoCo). Defaults ``beta=0.95``, ``outer_lr=1.0`` (plain SGD outer step: error feedback
plays the part of DiLoCo's outer momentum).

Devices: the round's start, the error-feedback buffers, every message and every decoded
tensor live on the parameters' device (:func:`lioncub.comm.device_of`); the message travels
through :func:`lioncub.comm.all_gather`.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .. import comm
from .base import broadcast_module
from .ddp import BETAS
from ..validate import check_int
from .local import Rounds, check_period
from .wire import Packer, Reader, all_gather_bytes, check_config, check_float, rows, unrows

__all__ = ["SparseLoCo", "encode", "decode"]

HI, LO, DROP = 0.75, 0.25, -1  # level thresholds as fractions of the row's max |e|; index of an unsent entry


def _values(scale: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Decoded values: bit 0 the level (1: ``s``, 0: ``s/2``), bit 1 the sign (1: negative)."""
    level = torch.where((code & 1).bool(), scale, scale * 0.5)
    return torch.where((code & 2).bool(), -level, level)


def encode(x: torch.Tensor, chunk: int, k: int, packer: Packer) -> torch.Tensor:
    """Top-``k`` per row of ``x`` (flat), quantized into ``packer``; returns the decoded values, flat."""
    n = x.numel()
    r = rows(x, chunk)
    mag, idx = r.abs().topk(k, dim=1)  # sorted: mag[:, 0] is the row's max |e|
    scale = mag[:, :1]
    keep = (mag >= LO * scale) & (scale > 0)
    sign = torch.gather(r, 1, idx) < 0
    code = (mag >= HI * scale).to(torch.uint8) | (sign.to(torch.uint8) << 1)
    sent = torch.where(keep, _values(scale, code), x.new_zeros(()))
    packer.add(scale.reshape(-1).float())
    packer.add(torch.where(keep, idx, DROP).to(torch.int16))
    flat = code.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)]).view(-1, 4)
    packer.add(flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6))
    return unrows(torch.zeros_like(r).scatter_(1, idx, sent), n)


def decode(reader: Reader, n: int, chunk: int, k: int) -> torch.Tensor:
    """What :func:`encode` wrote for a flat tensor of ``n`` elements, as that tensor (fp32, on the
    message's device)."""
    nrows = math.ceil(n / chunk)
    scale = reader.take(torch.float32, nrows).view(-1, 1)
    idx = reader.take(torch.int16, nrows * k).view(nrows, k).long()
    packed = reader.take(torch.uint8, math.ceil(nrows * k / 4))
    code = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[:nrows * k].view(nrows, k)
    val = torch.where(idx != DROP, _values(scale, code), scale.new_zeros(()))
    # an unsent entry adds 0.0 at index 0: harmless; the kept indices of a row are distinct
    return unrows(torch.zeros(nrows, chunk, device=scale.device).scatter_add_(1, idx.clamp(min=0), val), n)


class SparseLoCo(Rounds):
    """``H`` inner AdamW steps, then one sparse 2-bit, error-fed outer step (see the module doc).

    ``steps % H`` is the position inside the round; :meth:`state_dict` keeps it, the inner
    AdamW state, the round's start ``θ``, the error-feedback buffers and, mid-round, this
    rank's own parameters. ``sent_bytes``: the bytes this rank has put on the wire (its
    messages). ``last_message``: its latest message (for tests).
    """

    family = "adamw"

    def __init__(self, module: nn.Module, *, lr: float, H: int, k: int = 64, chunk: int = 4096,
                 beta: float = 0.95, outer_lr: float = 1.0, group=None, weight_decay: float = 0.0):
        super().__init__(module, group=group)
        self.H = check_period(H)
        self.chunk = check_int("chunk", chunk, 1, 32767, what="elements per row; indices travel as int16")
        self.k = check_int("k", k, 1, chunk, what="entries sent per row of chunk elements")
        self.beta = check_float("beta", beta, 0.0, 1.0, "error-feedback decay")
        self.outer_lr = check_float("outer_lr", outer_lr, 0.0, math.inf, "outer step size", low_open=True,
                                    high_open=True)
        self.name = f"sparseloco-h{H}"
        broadcast_module(module, group)
        self.params = list(module.parameters())
        self.device = comm.device_of(self.params)
        self.inner = torch.optim.AdamW(self.params, lr=lr, betas=BETAS, weight_decay=weight_decay)
        self.start = [p.detach().clone() for p in self.params]
        self.error = [torch.zeros_like(p) for p in self.params]
        # per tensor: (elements, row length, entries kept per row)
        self.layout = []
        for p in self.params:
            c = min(self.chunk, p.numel())
            self.layout.append((p.numel(), c, min(c, max(1, math.ceil(self.k * c / self.chunk)))))
        self.sent_bytes, self.last_message = 0, None

    @torch.no_grad()
    def outer_step(self) -> None:
        packer = Packer(self.device)
        for p, start, e, (_, c, k) in zip(self.params, self.start, self.error, self.layout):
            e.mul_(self.beta).add_(start - p)  # e ← β·e + Δ
            e.sub_(encode(e.reshape(-1), c, k, packer).view_as(e))  # exact (module doc)
        self.last_message = msg = packer.message()
        self.sent_bytes += msg.numel()
        readers = [Reader(m) for m in all_gather_bytes(msg, self.group, self.world)]
        for p, start, (n, c, k) in zip(self.params, self.start, self.layout):
            total = torch.zeros(n, device=self.device)
            for reader in readers:  # rank order: the same sum on every rank
                total += decode(reader, n, c, k)
            start.sub_(total.view_as(start), alpha=self.outer_lr / self.world)
            p.copy_(start)

    # ------------------------------------------------------------------ state
    def _config(self) -> dict:
        return dict(H=self.H, k=self.k, chunk=self.chunk, beta=self.beta, outer_lr=self.outer_lr, world=self.world)

    def state_dict(self) -> dict:
        mid = self.steps % self.H != 0
        return copy.deepcopy(dict(
            config=self._config(), steps=self.steps, sent_bytes=self.sent_bytes, inner=self.inner.state_dict(),
            start=self.start, error=self.error,
            # inside a round every rank's parameters are its own (a model checkpoint holds one rank's)
            params=[p.detach() for p in self.params] if mid else None))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        check_config(state_dict["config"], self._config())
        self.inner.load_state_dict(copy.deepcopy(state_dict["inner"]))
        self.steps, self.sent_bytes = int(state_dict["steps"]), int(state_dict["sent_bytes"])
        for mine, saved in zip(self.start + self.error, state_dict["start"] + state_dict["error"]):
            mine.copy_(saved)
        for p, saved in zip(self.params, state_dict["params"] or state_dict["start"]):
            p.copy_(saved)
