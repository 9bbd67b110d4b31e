"""``lioncub analyze`` as a user runs it: 2 gloo workers, a few steps of a tiny GPT, then
the instruments' JSON/CSV/PNG outputs and the thin example wrapper's importability."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_analyze_cli_writes_instruments_json(tmp_path, corpus_cache):
    out = tmp_path / "instruments"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CI="true", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    argv = ["analyze", "--workers", "2", "--steps", "3", "--every", "2", "--tie-every", "1", "--sync-every", "1",
            "--block-size", "16", "--batch-size", "2", "--out", str(out), "--cache-dir", str(corpus_cache)]
    proc = subprocess.run([sys.executable, "-m", "lioncub.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"wrote {out}" in proc.stdout
    with open(out / "instruments.json") as f:
        result = json.load(f)
    assert result["config"]["workers"] == 2 and result["config"]["steps"] == 3
    measured = result["measured"]
    assert [r["step"] for r in measured["records"]] == [2]  # every 2 steps from step 1, and the last (2)
    assert [t["step"] for t in measured["ties"]] == [0, 1, 2]
    assert "shakespeare" in measured["data"]  # the real corpus, not the random-token fallback
    summary = result["summary"]
    assert summary["step"] == 2 and math.isfinite(summary["final_loss"]) and 0 <= summary["tie_rate_mean"] <= 1
    assert {"wte.weight", "head.weight"} <= {name for name, *_ in summary["layers_by_max_std"]}
    for row in summary["sign_match"].values():  # the rates partition the elements
        assert abs(row["match"] + row["flip"] + row["zero"] + row["spurious"] - 1) < 1e-6
    assert summary["adaptive_run"]["checks"] == 3 and summary["adaptive_run"]["vote_bytes_per_step"] > 0
    with open(out / "sign_match.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(summary["sign_match"])
    for png in ("c_distribution.png", "sign_match.png", "tie_rate.png", "adaptive_divergence.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
