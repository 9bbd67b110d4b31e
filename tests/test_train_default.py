"""The default ``lioncub train``: where it runs (an emulated slow cluster when it can, loopback with one
line saying why otherwise), the three runs it compares, and the ``--link`` path end to end (root:
network namespaces, torn down after).

Tiny sizes (gpt-tiny, 2 workers, a few seconds of training each): what is checked is the path and what
it prints, not the speed-up (bench/README.md measures that)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lioncub.cli import DEFAULT_LINK, loopback_note
from lioncub.testbed import TESTBED_SWITCH
from lioncub.testbed import testbed_unavailable as _testbed_unavailable  # (its name starts with "test": pytest would run it)

from tests.test_harness_train import ROOT, read_csv, read_jsonl

TINY = ["--model", "gpt-tiny", "--batch-size", "4", "--block-size", "32", "--lr", "1e-3", "--nproc", "2",
        "--no-progress"]
LABELS = ["lion-grad-fp32", "lioncub-onebit-mean", "localcub-hauto-mean8"]  # README's recommended 1-bit setting
OURS = ("lct-", "lcprobe-")  # run_in_testbed's and the availability probe's namespace prefixes


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _train(*args, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1", CI="true")
    e["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + e.get("PYTHONPATH", "")
    e.pop(TESTBED_SWITCH, None)
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "lioncub.cli", "train", *args], env=e, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _check_comparison(out, printed: str) -> None:
    """Three runs, the time-to-loss lead before the per-step table, compare.csv and loss.png."""
    lead = printed.index("Time to the same loss")
    assert lead < printed.index("\nper step ")  # the table's header row
    for label in LABELS:
        assert label in printed
    assert printed.count("reached Lion fp32's final validation loss in") + printed.count("did not reach it") == 2
    rows = read_csv(out / "compare.csv")
    assert [r["label"] for r in rows] == LABELS
    base, cub, local = (float(r["bytes_sent_per_step"]) for r in rows)
    assert base > 10 * cub > 0 and cub > local > 0  # fp32 gradients, 1 bit each way, 8-bit lanes every H >= 10 steps
    for label in LABELS:
        evals = [r for r in read_jsonl(out / label / "metrics.jsonl") if r["kind"] == "eval"]
        assert evals and all(e["train_time"] > 0 for e in evals)
    local_steps = [r for r in read_jsonl(out / LABELS[2] / "metrics.jsonl") if r["kind"] == "step"]
    assert local_steps[-1]["bytes_sent"] > 0  # the budget ends a LocalCub run at the end of a round
    assert "local_steps='auto' picked H=" in printed  # and says what H the link gave it
    with open(out / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the whole default comparison (~18 s): .ci/run runs it after the suite
def test_default_falls_back_to_loopback_with_one_line_saying_why(tmp_path, corpus_cache):
    out = tmp_path / "cmp"
    proc = _train(*TINY, "--budget", "3", "--out", str(out), "--cache-dir", str(corpus_cache),
                  env={TESTBED_SWITCH: "0"})
    lines = proc.stdout.splitlines()
    assert lines[0] == loopback_note(f"{TESTBED_SWITCH}=0 turns the emulated link off")
    assert "sudo lioncub train" in lines[0] and "--link RATE" in lines[0]
    assert sum("on loopback, not behind an emulated slow link" in line for line in lines) == 1
    assert "link: loopback" in proc.stdout and "emulated cluster" not in proc.stdout
    assert "3 s of training each, 3 ways" in proc.stdout
    _check_comparison(out, proc.stdout)


@pytest.mark.slow  # ~7 s, a whole comparison: .ci/run runs it after the suite
def test_link_none_forces_loopback_without_the_note(tmp_path, corpus_cache):
    proc = _train(*TINY, "--steps", "4", "--eval-every", "2", "--link", "none", "--out", str(tmp_path / "cmp"),
                  "--cache-dir", str(corpus_cache))
    assert "not behind an emulated slow link" not in proc.stdout
    assert "link: loopback" in proc.stdout
    # step-matched (--steps): LocalCub's H is the largest <= 50 that divides the steps and eval period
    assert [r["label"] for r in read_csv(tmp_path / "cmp" / "compare.csv")] == [
        "lion-grad-fp32", "lioncub-onebit-mean", "localcub-h2-mean8"]


def test_availability_switch(monkeypatch):
    monkeypatch.setenv(TESTBED_SWITCH, "off")
    assert _testbed_unavailable() == f"{TESTBED_SWITCH}=off turns the emulated link off"


@pytest.mark.slow  # the whole default comparison (~18 s): .ci/run runs it after the suite
@pytest.mark.root
def test_default_runs_behind_the_emulated_link_and_tears_it_down(tmp_path, corpus_cache):
    assert _testbed_unavailable() is None  # root, ip, tc and namespaces: the default goes behind the link
    before = _namespaces()
    out = tmp_path / "cmp"
    proc = _train(*TINY, "--budget", "3", "--out", str(out), "--cache-dir", str(corpus_cache))
    assert "not behind an emulated slow link" not in proc.stdout
    assert f"behind a {'100 Mbit/s'} link" in proc.stdout and DEFAULT_LINK == "100mbit"
    assert "regime r = fp32 all-reduce / compute per step" in proc.stdout
    assert "Regime: lion-grad-fp32's all-reduce took" in proc.stdout
    _check_comparison(out, proc.stdout)
    assert {ns for ns in _namespaces() - before if ns.startswith(OURS)} == set()


@pytest.mark.root
def test_link_rate_single_run_end_to_end(tmp_path, corpus_cache):
    before = _namespaces()
    out = tmp_path / "one"
    proc = _train(*TINY, "--vote", "pbit", "--steps", "4", "--eval-every", "2", "--link", "20mbit",
                  "--out", str(out), "--cache-dir", str(corpus_cache))
    row = read_csv(out / "summary.csv")[0]
    assert row["label"] == "lioncub-pbit" and row["world_size"] == "2" and row["steps"] == "4"
    assert float(row["bytes_sent_per_step"]) > 0 and "lioncub-pbit" in proc.stdout
    assert {ns for ns in _namespaces() - before if ns.startswith(OURS)} == set()
