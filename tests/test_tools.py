"""The tools users already use: TensorBoard event files and a tqdm progress bar."""
from __future__ import annotations

import io

import pytest

from lioncub.harness.metrics import ProgressBar

from .conftest import require_module
from .test_harness_train import TINY, lioncub, read_jsonl


def test_progress_bar_is_tqdm_and_shows_step_and_text():
    require_module("tqdm")
    out = io.StringIO()
    bar = ProgressBar(4, label="lioncub-pbit", initial=1, file=out)
    for step in (2, 3, 4):
        bar.update(step, f"loss {5 - step:.3f} | 10 ms/step")
    bar.close()
    text = out.getvalue()
    assert "lioncub-pbit" in text and "4/4" in text and "100%" in text and "loss 1.000 | 10 ms/step" in text
    quiet = io.StringIO()
    ProgressBar(4, enabled=False, file=quiet).update(4, "x")
    assert quiet.getvalue() == ""


def test_tensorboard_events_hold_the_metrics_jsonl_values(tmp_path):
    require_module("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, board = tmp_path / "run", tmp_path / "tb"
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question. " * 400)
    lioncub("train", *TINY, "--no-compare", "--vote", "pbit", "--steps", "3", "--eval-every", "0", "--nproc", "2",
            "--data", str(tmp_path / "text.txt"), "--out", str(out), "--tensorboard", str(board),
            "--cache-dir", str(tmp_path / "cache"))
    events = EventAccumulator(str(board / "lioncub-pbit")).Reload()
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    for tag, key, scale in (("train/loss", "loss", 1), ("train/lr", "lr", 1), ("comm/bytes_sent_per_step", "bytes_sent", 1),
                            ("time_ms/step", "t_step", 1e3), ("time_ms/compute", "t_compute", 1e3),
                            ("time_ms/vote", "t_vote", 1e3), ("time_ms/other", "t_other", 1e3)):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [r["step"] for r in steps], tag
        assert [s.value for s in scalars] == pytest.approx([r[key] * scale for r in steps], rel=1e-5), tag
    (val,) = events.Scalars("val/loss")
    assert val.step == 3 and val.value == pytest.approx(records[-1]["val_loss"], rel=1e-5)
