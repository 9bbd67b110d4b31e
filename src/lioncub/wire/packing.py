"""Lane arithmetic of the packed-lane votes (docs/design.md §3): which lane width holds a sum.

The layouts themselves (packed by :mod:`lioncub.wire.kernels`):

* **Sign bits** — one bit per element, 8 elements per byte (little-endian within the
  byte: element ``8*j + k`` is bit ``k`` of byte ``j``). Used by ``gather`` and
  ``onebit``.
* **Lanes** — each element is an unsigned integer in ``[0, 2**w - 1]`` stored in a
  ``w``-bit lane, ``8 // w`` lanes per ``uint8`` (``w`` in 2, 4, 8). Because lanes
  never share a carry, a plain element-wise SUM of packed bytes across workers adds
  every lane independently, provided no lane sum exceeds ``2**w - 1``. That is the
  packed-lane ("p-bit") allreduce: the engine's tuned SUM allreduce does the vote
  arithmetic on packed data; :func:`lane_bits_for` picks a width where no sum overflows.
"""
from __future__ import annotations

__all__ = ["LANE_BITS", "lane_bits_for", "max_lane_value"]

LANE_BITS = (2, 4, 8)
"""Lane widths that tile a byte exactly (and so a uint8 allreduce)."""


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
