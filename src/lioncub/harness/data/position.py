"""Where a loader stands after a number of batches: what a replica that rejoins a run continues from."""
from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["seek_items"]


def seek_items(batches: int, batch_size: int, epoch_items: Callable[[int], np.ndarray]) -> tuple[int, int, np.ndarray]:
    """``(epoch, pos, items)`` of a loader that read ``batches`` batches of ``batch_size`` from its start, each epoch's
    items being ``epoch_items(epoch)`` (read in order, the next epoch begun when one is used up at the next read)."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise ValueError(f"batches must be an int >= 0, got {batches!r}")
    left, epoch = batches * batch_size, 0
    items = epoch_items(0)
    while left > len(items):
        left -= len(items)
        epoch += 1
        items = epoch_items(epoch)
    return epoch, left, items
