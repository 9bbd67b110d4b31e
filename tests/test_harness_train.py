"""End to end: ``lioncub train`` as a user runs it (subprocesses, real gloo workers).

One comparison run checks the outputs (JSONL, CSV, PNG, printed table); a run
under torchrun that checkpoints, resumed from its middle checkpoint by a local
``--nproc`` launch (bare ``--resume``), checks that a resumed run reproduces the uninterrupted one
bit for bit (1-bit vote with 2 workers: ties every step, so step parity matters;
ResNet: BatchNorm buffers are per rank).
"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "gpt-tiny", "--batch-size", "4", "--block-size", "32", "--lr", "1e-3", "--no-progress"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CI="true")
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def lioncub(*args, torchrun: int = 0) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}",
                "--standalone", "-m", "lioncub.cli"] if torchrun else [sys.executable, "-m", "lioncub.cli"]
    proc = subprocess.run(launcher + list(args), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_default_comparison_writes_wellformed_outputs(tmp_path):
    out = tmp_path / "cmp"
    printed = lioncub("train", *TINY, "--steps", "6", "--eval-every", "3", "--nproc", "2", "--out", str(out),
                      "--cache-dir", str(tmp_path / "cache"))
    labels = ["lion-grad-fp32", "lioncub-pbit"]
    for label in labels:
        assert label in printed
    assert "bytes sent / step" in printed and "compute (fwd+bwd)" in printed
    rows = read_csv(out / "compare.csv")
    assert [r["label"] for r in rows] == labels
    for row in rows:
        assert row["world_size"] == "2" and row["steps"] == "6"
        for key in ("final_val_loss", "t_step_ms", "t_compute_ms", "t_vote_ms", "tokens_per_s"):
            assert math.isfinite(float(row[key])) and float(row[key]) > 0, key
    base, cub = (float(r["bytes_sent_per_step"]) for r in rows)
    assert base > 10 * cub > 0  # fp32 gradients vs 4-bit lanes
    with open(out / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "loss.png") > 10_000
    for label in labels:
        records = read_jsonl(out / label / "metrics.jsonl")
        steps = [r for r in records if r["kind"] == "step"]
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in evals] == [3, 6]
        for r in steps:
            assert 0 < r["loss"] < 6 and r["bytes_sent"] > 0 and r["n_collectives"] >= 1
            assert r["t_step"] >= r["t_compute"] > 0 and r["t_vote"] > 0
            assert abs(r["t_compute"] + r["t_vote"] + r["t_other"] - r["t_step"]) < 1e-9
        assert steps[-1]["loss"] < steps[0]["loss"]
        assert read_csv(out / label / "summary.csv")[0]["label"] == label
    lioncub("plot", str(out / labels[0]), str(out / labels[1]), "-o", str(tmp_path / "overlay.png"))
    assert os.path.getsize(tmp_path / "overlay.png") > 10_000


@pytest.mark.parametrize("model_args", [
    ["--vote", "onebit", *TINY],
    ["--vote", "pbit", "--model", "resnet18", "--width", "8", "--batch-size", "8", "--no-progress"],
], ids=["gpt-onebit", "resnet-bn"])
def test_resume_reproduces_uninterrupted_run_bit_for_bit(tmp_path, model_args):
    common = [*model_args, "--steps", "6", "--eval-every", "3", "--cache-dir", str(tmp_path / "cache")]
    full = tmp_path / "full"
    lioncub("train", *common, "--ckpt-every", "3", "--out", str(full), torchrun=2)
    assert sorted(os.listdir(full / "ckpt")) == ["latest", "step_0000003", "step_0000006"]
    assert sorted(os.listdir(full / "ckpt" / "step_0000003")) == ["meta.json", "model.pt", "rank0.pt", "rank1.pt"]
    # An interrupted run: its checkpoint at step 3 and the records written up to step 4.
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "ckpt" / "step_0000003", resumed / "ckpt" / "step_0000003")
    (resumed / "ckpt" / "latest").write_text("step_0000003\n")
    records = read_jsonl(full / "metrics.jsonl")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= 4))
    lioncub("train", *common, "--nproc", "2", "--resume", "--out", str(resumed))  # bare --resume: the --out run
    after = read_jsonl(resumed / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in after] == [(r["kind"], r["step"]) for r in records]
    assert [r.get("loss", r.get("val_loss")) for r in after] == [r.get("loss", r.get("val_loss")) for r in records]


def test_cli_rejects_bad_arguments(capsys):
    from lioncub.cli import main

    for argv, message in ((["train", "--model", "gpt5"], "invalid choice: 'gpt5'"),
                          (["train", "--steps", "0", "--no-compare"], "steps must be >= 1"),
                          (["train", "--resume"], "--resume applies to a single run"),
                          (["plot", "/nonexistent-run"], "has no metrics.jsonl")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
