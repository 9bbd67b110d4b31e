"""Image data: scikit-learn's bundled digits (the offline default), ``.npz``
arrays and class-per-folder image trees, with a sharded, resumable loader.

Every source becomes ``ImageData``: float32 arrays (N, C, H, W) standardised
with the training split's per-channel mean and std, plus int64 labels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .position import seek_items

_IMAGE_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


@dataclass(kw_only=True)
class ImageData:
    x_train: np.ndarray
    """(N, C, H, W) float32, standardised."""
    y_train: np.ndarray
    """(N,) int64 class ids."""
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def info(self) -> dict:
        _, c, h, w = self.x_train.shape
        return {"num_classes": self.num_classes, "channels": c, "image_size": h, "height": h, "width": w}


def load_images(source: str, *, val_fraction: float = 1 / 6, seed: int = 0) -> ImageData:
    """``digits`` (sklearn, 1797 8x8 grey digits), an ``.npz`` file with ``x``, ``y``
    (and optionally ``x_val``, ``y_val``) or a folder of class sub-folders (optionally
    split into ``train/`` and ``val/``). Without an explicit validation split, a
    seeded ``val_fraction`` of the images is held out."""
    if source == "digits":
        x, y = digits()
        xv, yv = None, None
    elif source.endswith(".npz") and os.path.isfile(source):
        with np.load(source) as z:
            if "x" not in z or "y" not in z:
                raise ValueError(f"{source}: an .npz image set needs arrays 'x' and 'y'")
            x, y = z["x"], z["y"]
            xv, yv = (z["x_val"], z["y_val"]) if "x_val" in z else (None, None)
    elif os.path.isdir(source):
        if os.path.isdir(os.path.join(source, "train")):
            x, y, classes = _read_folder(os.path.join(source, "train"))
            xv, yv, _ = _read_folder(os.path.join(source, "val"), classes)
        else:
            (x, y, _), xv, yv = _read_folder(source), None, None
    else:
        raise ValueError(f"image data must be 'digits', an .npz file or an image folder; got {source!r}")
    if xv is None:
        order = np.random.default_rng(seed).permutation(len(x))
        n_val = max(1, int(len(x) * val_fraction))
        x, y, xv, yv = x[order[n_val:]], y[order[n_val:]], x[order[:n_val]], y[order[:n_val]]
    x, xv = _to_nchw(x), _to_nchw(xv)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.std(axis=(0, 2, 3), keepdims=True) + 1e-6
    num_classes = int(max(y.max(), yv.max())) + 1
    return ImageData(x_train=(x - mean) / std, y_train=y.astype(np.int64), x_val=(xv - mean) / std,
                     y_val=yv.astype(np.int64), num_classes=num_classes)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (UCI optdigits test set, 1797 8x8 images, 0..16), read
    from the package's data file without importing scikit-learn (saves seconds per worker)."""
    import gzip
    import importlib.metadata as metadata

    try:
        path = metadata.distribution("scikit-learn").locate_file("sklearn/datasets/data/digits.csv.gz")
    except metadata.PackageNotFoundError:
        raise ImportError("the default image set needs scikit-learn: pip install scikit-learn") from None
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)  # (1797, 65): 64 pixels, label
    return table[:, :-1].reshape(-1, 8, 8) / 16.0, table[:, -1].astype(np.int64)


def _to_nchw(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    if x.ndim == 3:  # (N, H, W) grey
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):  # (N, H, W, C)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim == 4:
        return x
    raise ValueError(f"image array must be (N, H, W), (N, H, W, C) or (N, C, H, W); got shape {x.shape}")


def _read_folder(root: str, classes: list[str] | None = None):
    from PIL import Image  # pillow comes with matplotlib

    classes = classes or sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError(f"image folder {root!r} has no class sub-folders")
    xs, ys = [], []
    for label, name in enumerate(classes):
        for fname in sorted(os.listdir(os.path.join(root, name))):
            if fname.lower().endswith(_IMAGE_EXT):
                with Image.open(os.path.join(root, name, fname)) as im:
                    xs.append(np.asarray(im.convert("RGB")))
                ys.append(label)
    if not xs:
        raise ValueError(f"image folder {root!r} has no images ({', '.join(_IMAGE_EXT)})")
    return np.stack(xs), np.array(ys), classes


class ImageLoader:
    """Batches of (images, labels) from one rank's disjoint shard of the training set.

    The training set is shuffled once with ``seed`` (so shards mix classes),
    split into ``world_size`` contiguous shards, and each epoch visits rank r's
    shard in a permutation drawn from ``(seed, rank, epoch)``; ``state_dict()``
    (epoch, position) resumes it exactly.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        order = np.random.default_rng([seed, 2**31 - 1]).permutation(len(x))
        self.indices = order[len(x) * rank // world_size : len(x) * (rank + 1) // world_size]
        if len(self.indices) < batch_size:
            raise ValueError(f"shard of {len(self.indices)} images is smaller than batch_size {batch_size}")
        self.x, self.y = x, y
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self.indices[np.random.default_rng([self.seed, self.rank, epoch]).permutation(len(self.indices))]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images (B, C, H, W) float32, labels (B,) int64)."""
        picked = []
        for _ in range(self.batch_size):
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            picked.append(self._order[self.pos])
            self.pos += 1
        return torch.from_numpy(self.x[picked]), torch.from_numpy(self.y[picked])

    def state_dict(self) -> dict:
        """Position: ``epoch``, ``pos`` (items of this epoch done) and ``epoch_len`` (items in
        this epoch; lets a checkpoint be re-sharded to another world size)."""
        return {"epoch": self.epoch, "pos": self.pos, "epoch_len": len(self._order)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._epoch_order(self.epoch)

    def seek(self, batches: int) -> None:
        """Stand where this loader would after ``batches`` batches from its start (a replica rejoining a run)."""
        self.epoch, self.pos, self._order = seek_items(batches, self.batch_size, self._epoch_order)


def image_eval_batches(x: np.ndarray, y: np.ndarray, *, batch_size: int, n_batches: int, rank: int = 0,
                       world_size: int = 1):
    """The fixed validation batches of ``rank``: images rank, rank+P, ..."""
    index = np.arange(rank, len(x), world_size)[: n_batches * batch_size]
    for i in range(0, len(index), batch_size):
        j = index[i : i + batch_size]
        yield torch.from_numpy(x[j]), torch.from_numpy(y[j])
