"""What the sparse peers (SparseLoCo, DeMo) share: chunked views, byte messages, argument checks.

Both cut each parameter tensor, flattened, into rows of ``chunk`` elements (the last row
zero-padded), pick ``k`` entries per row, and exchange one ``uint8`` message per rank
through ``all_gather`` (every rank's message has the same length: ``k`` is fixed per row).
Messages live on the parameters' device and travel through :func:`lioncub.comm.all_gather`.
"""
from __future__ import annotations

import math

import torch

from .. import comm

__all__ = ["rows", "unrows", "Packer", "Reader", "all_gather_bytes", "check_float", "check_config"]


def rows(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """``flat`` (n,) as (ceil(n/chunk), chunk), zero-padded at the end (a copy only when padded)."""
    n = flat.numel()
    pad = -n % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk)


def unrows(r: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of a (rows, chunk) block, flat: undoes :func:`rows`."""
    return r.reshape(-1)[:n]


class Packer:
    """Tensors of several dtypes laid end to end in one ``uint8`` message, and taken apart again.

    ``device``: where an empty message is made (a message of parts lies on their device)."""

    def __init__(self, device: torch.device | str | None = None):
        self.parts: list[torch.Tensor] = []
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def add(self, t: torch.Tensor) -> None:
        self.parts.append(t.contiguous().reshape(-1).view(torch.uint8))

    def message(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.uint8, device=self.device)


class Reader:
    """Reads back what :class:`Packer` laid out, in the same order."""

    def __init__(self, msg: torch.Tensor):
        self.msg, self.at = msg, 0

    def take(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        size = count * torch.empty(0, dtype=dtype).element_size()
        part = self.msg[self.at:self.at + size].clone()  # clone: an aligned start for the dtype view
        self.at += size
        return part.view(dtype)


def all_gather_bytes(msg: torch.Tensor, group=None, world: int = 1) -> list[torch.Tensor]:
    """Every rank's message (the same length on every rank, on the parameters' device), in rank order."""
    if world == 1:
        return [msg]
    return list(comm.all_gather(msg, group).unbind(0))




def check_float(name: str, value, low: float, high: float, what: str, *, low_open: bool = False,
                high_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} ({what}) must be a number in {span}, got {value!r}")
    return float(value)


def check_config(saved: dict, mine: dict) -> None:
    """A checkpoint resumes only into the configuration that wrote it (same knobs, same world size)."""
    for key, value in saved.items():
        if mine[key] != value:
            raise ValueError(f"checkpoint was saved with {key}={value!r} but this run has {key}={mine[key]!r}")
