"""Run records: JSONL metrics, a CSV summary and a terminal progress bar.

metrics.jsonl has one JSON object per line, ``{"kind": "step", ...}`` for a
training step and ``{"kind": "eval", ...}`` for an evaluation (fields in
``train.py``). summary.csv has one row per run.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time


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


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_csv(path: str, rows: list[dict]) -> None:
    """Rows of dicts to CSV; columns are the union of keys, in first-seen order."""
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
    """``[#####-----] 120/200 loss 2.31 | 85 ms/step`` redrawn in place on stderr."""

    def __init__(self, total: int, *, label: str = "", enabled: bool = True, width: int = 24):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self._last = 0.0

    def update(self, step: int, text: str = "") -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and step < self.total):
            return
        self._last = now
        filled = int(self.width * step / max(1, self.total))
        bar = "#" * filled + "-" * (self.width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {step}/{self.total} {text}\033[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
