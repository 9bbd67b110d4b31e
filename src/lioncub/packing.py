"""Bit packing for the compressed votes (docs/design.md §3). Pure functions on tensors.

Two layouts:

* **Sign bits** — one bit per element, 8 elements per byte (little-endian within the
  byte: element ``8*j + k`` is bit ``k`` of byte ``j``). Used by ``gather`` and
  ``onebit``.
* **Lanes** — each element is an unsigned integer in ``[0, 2**w - 1]`` stored in a
  ``w``-bit lane, ``8 // w`` lanes per ``uint8`` (``w`` in 2, 4, 8). Because lanes
  never share a carry, a plain element-wise SUM of packed bytes across workers adds
  every lane independently, provided no lane sum exceeds ``2**w - 1``. That is the
  packed-lane ("p-bit") allreduce: the engine's tuned SUM allreduce does the vote
  arithmetic on packed data.

All functions round-trip exactly for every length, including 0 and lengths not
divisible by 8; packed outputs are padded with zero bits.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import kernels

__all__ = [
    "LANE_BITS",
    "lane_bits_for",
    "max_lane_value",
    "pack_signs",
    "unpack_signs",
    "pack_lanes",
    "unpack_lanes",
    "packed_size",
]

LANE_BITS = (2, 4, 8)
"""Lane widths that tile a byte exactly (and so a uint8 allreduce)."""


def _check_lane_bits(bits: int) -> None:
    if bits not in LANE_BITS:
        raise ValueError(f"bits must be one of {LANE_BITS} (lane width), got {bits!r}")


def max_lane_value(world_size: int, levels: int | None = None) -> int:
    """Largest possible lane sum over ``world_size`` workers.

    ``levels=None`` is the binary sign encoding (each worker sends 0 or 1);
    ``levels=s`` is a quantizer with values in ``[-s, s]`` offset to ``[0, 2s]``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if levels is None:
        return world_size
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    return 2 * levels * world_size


def lane_bits_for(world_size: int, levels: int | None = None) -> int:
    """Smallest lane width in :data:`LANE_BITS` whose lanes cannot overflow.

    A lane of ``w`` bits holds sums up to ``2**w - 1``; see :func:`max_lane_value`.
    Raises ``ValueError`` when even 8-bit lanes would overflow.
    """
    need = max_lane_value(world_size, levels)
    for w in LANE_BITS:
        if need <= (1 << w) - 1:
            return w
    enc = "binary signs" if levels is None else f"values in [-{levels}, {levels}]"
    raise ValueError(
        f"no lane width in {LANE_BITS} can hold the sum of {world_size} workers' {enc} "
        f"(max lane sum {need} > 255); use fewer levels, vote='onebit' or vote='gather'"
    )


def packed_size(n: int, bits: int) -> int:
    """Bytes needed to pack ``n`` elements of ``bits`` bits (1 = sign bits)."""
    if bits != 1:
        _check_lane_bits(bits)
    per_byte = 8 // bits
    return -(-n // per_byte)


def _pack(values: Tensor, bits: int) -> Tensor:
    # values: (n,) integer tensor in [0, 2**bits); returns (ceil(n*bits/8),) uint8.
    # Word-folding kernel (lioncub.kernels): no int64 temporary, no reduction over lanes.
    n = values.numel()
    if values.dtype not in (torch.uint8, torch.bool):
        values = values.to(torch.uint8)
    return kernels.pack_bytes(values.reshape(-1), n, bits)


def _unpack(packed: Tensor, n: int, bits: int) -> Tensor:
    per_byte = 8 // bits
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {packed.dtype}")
    if packed.numel() * per_byte < n:
        raise ValueError(f"packed holds {packed.numel() * per_byte} elements, fewer than n={n}")
    return kernels.unpack_bytes(packed, n, bits)  # (n,) uint8 via a 256-entry table


def pack_signs(positive: Tensor) -> Tensor:
    """Pack a boolean tensor (True = +1) into bits, 8 per byte. Returns flat uint8."""
    if positive.dtype != torch.bool:
        raise TypeError(f"positive must be a bool tensor, got {positive.dtype}")
    return _pack(positive.reshape(-1), 1)


def unpack_signs(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_signs`: the first ``n`` bits as a bool tensor."""
    return _unpack(packed, n, 1).view(torch.bool)


def pack_lanes(values: Tensor, bits: int) -> Tensor:
    """Pack unsigned integers in ``[0, 2**bits - 1]`` into ``bits``-wide lanes of uint8."""
    _check_lane_bits(bits)
    v = values.reshape(-1)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > (1 << bits) - 1):
        raise ValueError(
            f"values must lie in [0, {(1 << bits) - 1}] for {bits}-bit lanes, "
            f"got range [{int(v.min())}, {int(v.max())}]"
        )
    return _pack(v.to(torch.uint8), bits)


def unpack_lanes(packed: Tensor, n: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_lanes`: ``n`` lane values as int16 (room for signed offsets)."""
    _check_lane_bits(bits)
    return _unpack(packed, n, bits).to(torch.int16)
