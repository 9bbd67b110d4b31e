"""End to end: ``lioncub train`` as a user runs it (subprocesses, real gloo workers).

One comparison run checks the outputs (JSONL, CSV, PNG, printed table); a run
under torchrun that checkpoints, resumed from its middle checkpoint by a local
``--nproc`` launch (bare ``--resume``), checks that a resumed run reproduces the uninterrupted one
bit for bit (1-bit vote with 2 workers: ties every step, so step parity matters;
ResNet: BatchNorm buffers are per rank), and then continues the GPT run on 3 workers
(another world size: momenta and data re-sharded). A torchrun job that loses a worker
restarts (``--max-restarts``) and ``--auto-resume`` continues it from its checkpoint.
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
import torch

from tests.dist import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "gpt-tiny", "--batch-size", "4", "--block-size", "32", "--lr", "1e-3", "--no-progress"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CI="true")
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def lioncub(*args, torchrun: int = 0, restarts: int = 0, entry: tuple = ("-m", "lioncub.cli")) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}",
                f"--max-restarts={restarts}", "--standalone"] if torchrun else [sys.executable]
    proc = subprocess.run(launcher + list(entry) + list(args), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # ~9 s, the whole comparison (tests/test_readme.py checks its output lines): .ci/run runs it after the suite
def test_default_comparison_writes_wellformed_outputs(tmp_path, corpus_cache):
    out = tmp_path / "cmp"
    printed = lioncub("train", *TINY, "--steps", "6", "--eval-every", "3", "--nproc", "2", "--out", str(out),
                      "--cache-dir", str(corpus_cache), "--link", "none")  # loopback (tests/test_train_default.py: the link)
    labels = ["lion-grad-fp32", "lioncub-onebit-mean", "localcub-h3-mean8"]  # step-matched: LocalCub at H = 3
    for label in labels:
        assert label in printed
    assert "bytes sent / step" in printed and "compute (fwd+bwd)" in printed
    rows = read_csv(out / "compare.csv")
    assert [r["label"] for r in rows] == labels
    for row in rows:
        assert row["world_size"] == "2" and row["steps"] == "6"
        for key in ("final_val_loss", "t_step_ms", "t_compute_ms", "t_vote_ms", "tokens_per_s"):
            assert math.isfinite(float(row[key])) and float(row[key]) > 0, key
    base, cub, local = (float(r["bytes_sent_per_step"]) for r in rows)
    assert base > 10 * cub > 0 and local > 0  # fp32 gradients vs one bit each way; 8-bit lanes every 3 steps
    with open(out / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "loss.png") > 10_000
    for label in labels[:2]:  # every step communicates (LocalCub: every third, below)
        records = read_jsonl(out / label / "metrics.jsonl")
        steps = [r for r in records if r["kind"] == "step"]
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in evals] == [3, 6]
        train_time = 0.0
        for r in steps:
            assert 0 < r["loss"] < 6 and r["bytes_sent"] > 0 and r["n_collectives"] >= 1
            # the parts are disjoint intervals inside the step (t_other = t_step - the others, by
            # definition; what can fail is the split): each positive, neither timed part the whole
            # step (the step also loads the batch and applies the update)
            assert r["t_compute"] > 0 and r["t_vote"] > 0 and r["t_other"] > 0, r
            assert r["t_compute"] < r["t_step"] and r["t_vote"] < r["t_step"], r
            train_time += r["t_step"]
            assert r["train_time"] == pytest.approx(train_time, rel=1e-12)  # the sum of t_step so far
            assert r["tokens_per_s"] == pytest.approx(4 * 32 * 2 / r["t_step"], rel=1e-12)  # batch x block x world
        assert steps[-1]["loss"] < steps[0]["loss"]
        assert read_csv(out / label / "summary.csv")[0]["label"] == label
    local = [r for r in read_jsonl(out / labels[2] / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in local] == [1, 2, 3, 4, 5, 6]
    assert [r["bytes_sent"] > 0 for r in local] == [False, False, True] * 2  # one round per 3 steps
    lioncub("plot", str(out / labels[0]), str(out / labels[1]), "-o", str(tmp_path / "overlay.png"))
    assert os.path.getsize(tmp_path / "overlay.png") > 10_000


@pytest.mark.parametrize("model_args", [
    pytest.param(["--vote", "onebit", *TINY], marks=pytest.mark.slow),  # ~19 s: two runs and a resume
    pytest.param(["--vote", "onebit", "--aggregate", "mean", *TINY], marks=pytest.mark.slow),  # the 1-bit mean
    pytest.param(["--vote", "pbit", "--model", "resnet18", "--width", "8", "--batch-size", "8", "--no-progress"],
                 marks=pytest.mark.slow),  # ~20 s; the GPT case runs the same resume path (BN buffers: here only)
], ids=["gpt-onebit", "gpt-onebit-mean", "resnet-bn"])
def test_resume_reproduces_uninterrupted_run_bit_for_bit(tmp_path, model_args, corpus_cache):
    common = [*model_args, "--steps", "6", "--eval-every", "3", "--cache-dir", str(corpus_cache)]
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
    if "mean" in model_args:  # the run was the 1-bit mean (its checkpoint says so); its owner residuals do not reshard
        saved = torch.load(full / "ckpt" / "step_0000003" / "rank0.pt", weights_only=True)["optimizer"]["lioncub"]
        assert (saved["config"]["aggregate"], saved["config"]["mean_restart"]) == ("mean", 50)
        return
    if "resnet18" in model_args:
        return
    # The same checkpoint continued on 3 workers: momenta averaged, data shards re-cut (replicas checked).
    three = tmp_path / "three"
    lioncub("train", *model_args, "--steps", "8", "--eval-every", "0", "--check-every", "1", "--nproc", "3",
            "--resume", str(full / "ckpt" / "step_0000006"), "--out", str(three), "--cache-dir", str(corpus_cache))
    steps = [r for r in read_jsonl(three / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [7, 8] and all(0 < r["loss"] < 6 for r in steps)
    assert read_csv(three / "summary.csv")[0]["world_size"] == "3"


def _timed_steps(rank, world, out, cache):
    """train_worker in this gloo group, with each LionCub step's own last_step_stats recorded."""
    import dataclasses

    from lioncub import LionCub  # the class the harness builds
    from lioncub.harness.config import TrainConfig
    from lioncub.harness.train import train_worker

    seen, real = [], LionCub.step

    def step(self, *args, **kwargs):
        loss = real(self, *args, **kwargs)
        seen.append(dataclasses.asdict(self.last_step_stats))
        return loss

    LionCub.step = step
    try:
        train_worker(TrainConfig(model="gpt-tiny", batch_size=4, block_size=32, lr=1e-3, steps=4, eval_every=0,
                                 nproc=world, out=out, cache_dir=cache, progress=False))
    finally:
        LionCub.step = real
    return seen, read_jsonl(os.path.join(out, "metrics.jsonl")) if rank == 0 else None


def test_step_times_are_the_optimizers_own(tmp_path, corpus_cache):
    """Each step record's t_vote is LionCub's own split of its vote (last_step_stats:
    quantize/pack + collectives + unpack/vote, as train.py sums it), bytes and collectives are
    its own, and its apply time lies in t_other: the three timed parts do not overlap."""
    seen, records = run_workers(_timed_steps, 2, str(tmp_path / "run"), str(corpus_cache))[0]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and len(seen) == 4
    for r, s in zip(steps, seen):
        assert r["t_vote"] == s["t_quantize_pack"] + s["t_collective"] + s["t_unpack_vote"], (r, s)
        assert 0 < s["t_collective"] < r["t_vote"] and s["t_quantize_pack"] > 0, s
        assert (r["bytes_sent"], r["bytes_recv"], r["n_collectives"]) == (
            s["bytes_sent"], s["bytes_recv"], s["n_collectives"])
        assert 0 < s["t_apply"] <= r["t_other"], (r, s)  # applied inside the step, outside compute and vote


def _losses(records):
    return [r.get("loss", r.get("val_loss")) for r in records]


def _resumed_from(full, step: int, resumed, common) -> list:
    """Resume run ``full``'s checkpoint at ``step`` in a new run directory; its logged losses."""
    name = f"step_{step:07d}"
    shutil.copytree(full / "ckpt" / name, resumed / "ckpt" / name)
    (resumed / "ckpt" / "latest").write_text(name + "\n")
    records = read_jsonl(full / "metrics.jsonl")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
    lioncub("train", *common, "--resume", "--out", str(resumed))
    return _losses(read_jsonl(resumed / "metrics.jsonl"))


@pytest.mark.slow  # ~20 s; tests/test_local_steps.py resumes LocalCub bit for bit in-process
def test_local_steps_train_and_resume_mid_round_bit_for_bit(tmp_path, corpus_cache):
    """--local-steps 2: bytes travel only at the end of a round; a run resumed from a checkpoint
    taken inside a round (step 3) reproduces the uninterrupted one exactly (residuals, θ_start,
    the inner AdamW state and the position in the round are saved)."""
    common = [*TINY, "--vote", "pbit", "--bits", "8", "--quantizer", "l1", "--local-steps", "2", "--inner", "adamw",
              "--aggregate", "mean", "--error-feedback", "--outer-lr", "0.7", "--steps", "6", "--eval-every", "2",
              "--check-every", "1", "--nproc", "2", "--cache-dir", str(corpus_cache)]
    full = tmp_path / "full"
    lioncub("train", *common, "--ckpt-every", "3", "--out", str(full))
    records = read_jsonl(full / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["bytes_sent"] > 0 for r in steps] == [False, True] * 3
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]
    assert read_csv(full / "summary.csv")[0]["label"] == "lioncub-pbit-8b-l1-h2-mean"
    assert _resumed_from(full, 3, tmp_path / "resumed", common) == _losses(records)


# Run by torchrun in place of `-m lioncub.cli`: on the first attempt rank 1 dies right after
# the first checkpoint, so torchrun restarts both workers with the same arguments.
_DIE_AFTER_FIRST_CKPT = """
import os, sys
from lioncub import cli
from lioncub.harness import checkpoint

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(sys.argv[1], "a") as f:
    f.write(f"rank {os.environ['RANK']} attempt {attempt}\\n")
save = checkpoint.save_checkpoint

def save_then_die(*args, **kwargs):
    path = save(*args, **kwargs)
    if attempt == "0" and os.environ["RANK"] == "1":
        os._exit(3)
    return path

checkpoint.save_checkpoint = save_then_die
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow  # ~17 s of torchrun restarts; tests/test_checkpoint_trust.py covers --auto-resume
def test_elastic_restart_auto_resumes_from_latest_checkpoint(tmp_path, corpus_cache):
    """torchrun --max-restarts=1 + --auto-resume: the restarted job continues from ckpt/latest."""
    out, log = tmp_path / "run", tmp_path / "attempts.txt"
    (tmp_path / "die.py").write_text(_DIE_AFTER_FIRST_CKPT)
    lioncub(str(log), "train", *TINY, "--vote", "auto", "--momentum-sync", "io", "--sync-every", "2",
            "--nonfinite", "skip_step", "--check-every", "1", "--ckpt-every", "2", "--eval-every", "0",
            "--timeout", "60", "--cache-dir", str(corpus_cache), "--out", str(out), "--auto-resume",
            "--steps", "4", torchrun=2, restarts=1, entry=(str(tmp_path / "die.py"),))
    assert sorted(log.read_text().splitlines()) == [f"rank {r} attempt {a}" for r in (0, 1) for a in (0, 1)]
    records = read_jsonl(out / "metrics.jsonl")  # steps 1-2 from attempt 0, 3-4 from attempt 1
    assert [(r["kind"], r["step"]) for r in records] == [("step", s) for s in (1, 2, 3, 4)] + [("eval", 4)]
    assert all(math.isfinite(r["loss"]) and r["skipped_steps"] == 0 for r in records[:4])
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000004"
    row = read_csv(out / "summary.csv")[0]  # attempt 1's: it ran steps 3-4
    assert row["steps"] == "4" and row["skipped_steps"] == "0" and row["momentum_sync"] == "io"
    assert row["vote"] == "auto" and row["vote_chosen"].split("/")[0] in ("sign_allreduce", "gather", "onebit", "pbit")


def test_cli_rejects_bad_arguments(capsys):
    from lioncub.cli import main

    for argv, message in ((["train", "--model", "gpt5"], "invalid choice: 'gpt5'"),
                          (["train", "--steps", "0", "--no-compare"], "steps must be >= 1"),
                          (["train", "--resume"], "apply to a single run"),
                          (["train", "--auto-resume"], "apply to a single run"),
                          (["train", "--optimizer", "adamw", "--overlap"], "apply to optimizer='lioncub' only"),
                          (["train", "--no-compare", "--local-steps", "0"], "local_steps must be >= 1"),
                          (["train", "--no-compare", "--outer-lr", "2"], "apply to local_steps > 1 only"),
                          (["train", "--no-compare", "--local-steps", "3"], "must be a multiple of local_steps=3"),
                          (["train", "--no-compare", "--local-steps", "2", "--overlap", "--eval-every", "2"],
                           "overlap=True is not supported with local_steps > 1"),
                          (["train", "--no-compare", "--local-steps", "2", "--aggregate", "mean", "--eval-every", "2"],
                           "aggregate='mean' on vote='pbit' needs quantizer='l1' (the lane mean)"),
                          (["train", "--no-compare", "--aggregate", "mean"], "it needs vote='onebit', got vote='pbit'"),
                          (["train", "--no-compare", "--timeout", "0"], "timeout must be > 0"),
                          (["analyze", "--vote", "grad"], "vote must be one of"),
                          (["plot", "/nonexistent-run"], "has no metrics.jsonl")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_env_reports_versions_backends_and_the_fused_loops(capsys):
    import torch
    import torch.distributed as dist

    from lioncub import __version__, fused
    from lioncub.cli import env_report, main

    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = dict(env_report())
    assert len(lines) == len(rows)
    for (key, value), line in zip(rows.items(), lines):  # one aligned line per row, in order
        assert line.startswith(key) and line.endswith(value) and line[len(key):-len(value)].strip() == ""
    assert rows["lioncub"] == __version__ and rows["torch"] == torch.__version__
    assert rows["gloo"] == ("yes" if dist.is_gloo_available() else "no")
    assert rows["fused CPU loops"] == fused.status()


@pytest.mark.slow  # ~35 s; tests/test_hierarchy.py checks NodeCub's step on 4 ranks
def test_nodes_train_and_resume_bit_for_bit(tmp_path, corpus_cache):
    """--nodes 2 on 4 workers (NodeCub, sharded): replicas checked every step, each rank's
    momentum shard is checkpointed, and a resumed run reproduces the uninterrupted one exactly."""
    common = [*TINY, "--vote", "onebit", "--nodes", "2", "--steps", "4", "--eval-every", "2", "--check-every", "1",
              "--nproc", "4", "--cache-dir", str(corpus_cache)]
    full = tmp_path / "full"
    lioncub("train", *common, "--ckpt-every", "2", "--out", str(full))
    records = read_jsonl(full / "metrics.jsonl")
    row = read_csv(full / "summary.csv")[0]
    assert (row["label"], row["nodes"], row["vote_chosen"]) == ("lioncub-onebit-2nodes", "2", "onebit")
    assert _resumed_from(full, 2, tmp_path / "resumed", common) == _losses(records)
