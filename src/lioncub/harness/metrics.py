"""Run records: JSONL metrics, a CSV summary, TensorBoard events and a terminal progress bar (tqdm).

metrics.jsonl has one JSON object per line, ``{"kind": "step", ...}`` for a
training step and ``{"kind": "eval", ...}`` for an evaluation (fields in
``train.py``). summary.csv has one row per run.
"""
from __future__ import annotations

import csv
import json
import os
import sys


class MetricsWriter:
    """Appends records to ``path`` (rank 0 only; other ranks pass ``enabled=False``)."""

    def __init__(self, path: str, *, enabled: bool = True, truncate_after_step: int | None = None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if truncate_after_step is None:
            open(path, "w").close()
        else:  # resuming: keep records up to the checkpoint, drop the ones after it
            kept = [r for r in read_jsonl(path) if r.get("step", 0) <= truncate_after_step] if os.path.exists(path) else []
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_jsonl(path: str, *, partial: bool = False) -> list[dict]:
    """The records of a JSONL file, one per non-blank line.

    ``partial``: the file may still be growing (a study appending to it): a missing file is no
    records and a torn last line is skipped (a torn line before the last still raises)."""
    if partial and not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if not (partial and i == len(lines) - 1):
                raise
    return out


def write_csv(rows: list[dict], path: str) -> None:
    """Rows of flat dicts to CSV at ``path`` (directories made); columns are the union of keys, in
    first-seen order. The harness's one CSV writer (summary.csv, and :mod:`.report`'s)."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def progress_enabled(requested: bool = True) -> bool:
    """A bar only on an interactive terminal, never when CI=true."""
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    return requested and not ci and sys.stderr.isatty()


class ProgressBar:
    """``lioncub-pbit:  48%|#####     | 120/250 [00:10<00:11, 11.6step/s, loss 2.31 | 85 ms/step]``: a tqdm
    bar on stderr (none when disabled or when tqdm is not installed)."""

    def __init__(self, total: int, *, label: str = "", enabled: bool = True, initial: int = 0, file=None):
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is a nicety: train without one
                return
            self._bar = tqdm(total=total, initial=initial, desc=label, unit="step", file=file or sys.stderr,
                             dynamic_ncols=True, mininterval=0.1)

    def update(self, step: int, text: str = "") -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_TENSORBOARD_SCALARS = {  # metrics.jsonl key -> (TensorBoard tag, scale)
    "loss": ("train/loss", 1), "lr": ("train/lr", 1), "tokens_per_s": ("train/tokens_per_s", 1),
    "images_per_s": ("train/images_per_s", 1), "bytes_sent": ("comm/bytes_sent_per_step", 1),
    "bytes_recv": ("comm/bytes_recv_per_step", 1), "n_collectives": ("comm/collectives_per_step", 1),
    "t_step": ("time_ms/step", 1e3), "t_compute": ("time_ms/compute", 1e3), "t_vote": ("time_ms/vote", 1e3),
    "t_other": ("time_ms/other", 1e3), "val_loss": ("val/loss", 1), "val_acc": ("val/acc", 1),
}


class TensorBoardWriter:
    """The metrics.jsonl records as TensorBoard scalars (``--tensorboard DIR``; rank 0 only).

    Needs the ``tensorboard`` package (``torch.utils.tensorboard``). A resumed run
    (``purge_step``) hides the events the interrupted run wrote after its checkpoint."""

    def __init__(self, log_dir: str | None, *, enabled: bool = True, purge_step: int | None = None):
        self._writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir, purge_step=purge_step)

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        for key, (tag, scale) in _TENSORBOARD_SCALARS.items():
            if key in record:
                self._writer.add_scalar(tag, record[key] * scale, record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
