"""Every ``lioncub train`` flag (and ``prepare``, ``plot --title``, ``bench``) takes effect.

Each check compares a run with the flag against a run without it (same seed), on what the flag
should change: the loss, the recorded lr, the number of records, the bytes per step, the
parameter count, the label, or the config a checkpoint records. A run with only
``--eval-batches`` changed is the control: its training losses must match the base run's bit
for bit, so a difference elsewhere is the flag's doing, not noise.

To keep this cheap, the ``lioncub train`` commands run in-process (``lioncub.cli.main``) on one
2-rank gloo group (``tests/dist.py``): inside an initialised group the harness trains on it
instead of spawning workers, so ~20 tiny runs cost one spawn.
"""
from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from lioncub import cli
from lioncub.cli import main
from tests.dist import run_workers

WORLD = 2
LR = 1e-3
TINY = ["--model", "gpt-tiny", "--batch-size", "2", "--block-size", "16", "--steps", "4", "--eval-every", "0",
        "--lr", str(LR), "--no-progress", "--nproc", str(WORLD)]

# name -> extra flags; every run is TINY + --data + --out RUNS/name + these.
RUNS = {
    "base": ["--optimizer", "lioncub"],
    "evalb": ["--optimizer", "lioncub", "--eval-batches", "3"],  # the control: same training as base
    "seed": ["--optimizer", "lioncub", "--seed", "1"],
    "betas": ["--optimizer", "lioncub", "--betas", "0.5", "0.9"],
    "dropout": ["--optimizer", "lioncub", "--dropout", "0.3"],
    "wd": ["--optimizer", "lioncub", "--weight-decay", "2.0"],
    "lr_embed": ["--optimizer", "lioncub", "--lr-embed", "3e-2"],
    # untied + --name + --log-every + --warmup-steps: each has its own observable
    "untied": ["--optimizer", "lioncub", "--untied", "--name", "my-untied-run", "--log-every", "3",
               "--warmup-steps", "4"],
    "lr_head": ["--optimizer", "lioncub", "--untied", "--name", "my-untied-run", "--log-every", "3",
                "--warmup-steps", "4", "--lr-head", "3e-2"],
    "grad_fp32": ["--vote", "grad"],
    "grad_bf16": ["--vote", "grad", "--grad-dtype", "bf16"],
    "lion": ["--optimizer", "lion"],
    "adamw": ["--optimizer", "adamw"],
    # real-valued pseudo-gradients (vote grad): a sign vote's first sgd and lion outer steps coincide
    "outer_nesterov": ["--local-steps", "2", "--vote", "grad"],
    "outer_sgd": ["--local-steps", "2", "--vote", "grad", "--outer", "sgd"],
    "outer_lion": ["--local-steps", "2", "--vote", "grad", "--outer", "lion"],
    "local_auto": ["--local-steps", "2", "--vote", "auto"],  # auto without alpha/beta: calibrates
    # streamed rounds, with and without the eager stand-in (outer Nesterov: its step by Δ_i is not the rebase)
    "stream": ["--local-steps", "2", "--vote", "grad", "--delay", "1", "--ckpt-every", "4"],
    "eager": ["--local-steps", "2", "--vote", "grad", "--delay", "1", "--eager", "--ckpt-every", "4"],
    # H from the link (measured) and the first round's 10 timed steps; the scatter mean at 2 bits
    "steps_auto": ["--local-steps", "auto", "--vote", "onebit", "--aggregate", "mean", "--bits", "2",
                   "--error-feedback", "--steps", "16"],
    # everything at once, with a checkpoint whose meta.json records the config
    "recorded": ["--optimizer", "lioncub", "--vote", "grad", "--betas", "0.8", "0.95", "--dropout", "0.1",
                 "--eval-batches", "2", "--grad-dtype", "bf16", "--log-every", "2", "--lr-embed", "2e-3",
                 "--lr-head", "4e-3", "--name", "everything", "--seed", "7", "--untied", "--warmup-steps", "3",
                 "--weight-decay", "0.5", "--ckpt-every", "4"],
}


def _corpus(path) -> str:
    rng = random.Random(0)
    words = "the king queen lord love death night day sword crown heart blood fair sweet noble my thy thou".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(500)) + "\n"
    path.write_text(text)
    return text


def _train_all(rank, world, argvs):
    """Every rank runs each ``lioncub train`` command in turn, on this group (no spawn)."""
    for argv in argvs:
        assert main(argv) == 0


def _auto_picks(rank, world):
    """LocalCub vote='auto' with no alpha/beta (measures them); LionCub's pick with and without gamma."""
    import torch

    from tests.flat import LionCub, LocalCub
    from lioncub.engine.auto import AUTO_CANDIDATES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    local = LocalCub(model.parameters(), lr=1e-3, local_steps=2, vote="auto")
    alpha, beta = local.auto_alpha_beta
    x = torch.randn(8, 64)
    for _ in range(2):  # one round: the picked vote runs
        model(x).square().mean().backward()
        local.step()
        local.zero_grad()
    kw = dict(lr=1e-3, vote="auto", alpha=1e-4, beta=1e-9)
    plain = LionCub(model.parameters(), **kw).vote_chosen
    priced = LionCub(model.parameters(), **kw, gamma={plain[0]: 1.0}).vote_chosen  # 1 s per element: never pick it
    return dict(local=local.vote_chosen, alpha=alpha, beta=beta, rounds=local.rounds,
                sent=local.last_round_stats.bytes_sent, plain=plain, priced=priced, candidates=AUTO_CANDIDATES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    text = _corpus(d / "corpus.txt")
    assert main(["prepare", "--data", str(d / "corpus.txt"), "--out", str(d / "tok")]) == 0
    argvs = [["train", *TINY, "--data", str(d / "tok"), "--out", str(d / name), *extra] for name, extra in RUNS.items()]
    run_workers(_train_all, WORLD, argvs, timeout_s=120.0)
    return d, text


def records(d, name, kind="step"):
    with open(d / name / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def summary(d, name):
    with open(d / name / "summary.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    return row


def losses(d, name):
    return [r["loss"] for r in records(d, name)]


def test_prepare_writes_train_and_val_bins(runs):
    d, text = runs
    n = len(text.encode())
    n_val = max(1, int(n * 0.1))
    tok = d / "tok"
    assert os.path.getsize(tok / "train.bin") == 2 * (n - n_val) and os.path.getsize(tok / "val.bin") == 2 * n_val
    ids = np.concatenate([np.fromfile(tok / "train.bin", np.uint16), np.fromfile(tok / "val.bin", np.uint16)])
    assert bytes(ids.astype(np.uint8)) == text.encode()  # byte-level tokens, in order
    meta = json.loads((tok / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (n - n_val, n_val, 256)


def test_prepare_default_out_is_the_cache_entry(tmp_path, capsys):
    _corpus(tmp_path / "plays.txt")
    assert main(["prepare", "--data", str(tmp_path / "plays.txt"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert sorted(os.listdir(tmp_path / "cache" / "plays-bytes")) == ["meta.json", "train.bin", "val.bin"]
    assert "train.bin (" in capsys.readouterr().out


def test_control_eval_batches_changes_only_the_val_loss(runs):
    d, _ = runs
    assert len(losses(d, "base")) == 4
    assert losses(d, "evalb") == losses(d, "base")  # deterministic: the flags below are what differ
    (base_eval,), (evalb_eval,) = records(d, "base", "eval"), records(d, "evalb", "eval")
    assert evalb_eval["val_loss"] != base_eval["val_loss"]  # 3 batches per worker averaged, not 4


@pytest.mark.parametrize("name", ["seed", "betas", "dropout", "wd", "lr_embed"])
def test_flag_changes_the_training(runs, name):
    d, _ = runs
    base, run = losses(d, "base"), losses(d, name)
    assert len(run) == 4 and all(0 < x < 10 for x in run)
    if name in ("seed", "dropout"):  # another init / dropped units in the first forward: differs at once
        assert run[0] != base[0]
    else:  # same init and first batch: the first update differs, so the later losses do
        assert run[0] == base[0] and run[1:] != base[1:]


def test_untied_name_log_every_warmup_and_lr_head(runs):
    d, _ = runs
    tied, untied = summary(d, "base"), summary(d, "untied")
    extra = int(untied["params"]) - int(tied["params"])
    assert extra > 0 and extra % 256 == 0  # a separate vocab x n_embd head
    assert untied["label"] == "my-untied-run" and tied["label"] == "lioncub-onebit-mean"  # --name labels the run; LionCub's default
    steps = records(d, "untied")
    assert [r["step"] for r in steps] == [3, 4]  # --log-every 3 (and the last step)
    assert [r["step"] for r in records(d, "base")] == [1, 2, 3, 4]
    # --warmup-steps 4: lr = LR * (step) / 4 during warm-up; the default (10) gives LR * step / 10
    assert steps[0]["lr"] == pytest.approx(LR * 3 / 4) and steps[1]["lr"] == pytest.approx(LR)
    assert records(d, "base")[2]["lr"] == pytest.approx(LR * 3 / 10)
    # --lr-head only matters with an untied head
    assert losses(d, "lr_head") != losses(d, "untied")


def test_grad_dtype_bf16_halves_the_bytes(runs):
    d, _ = runs
    fp32, bf16 = summary(d, "grad_fp32"), summary(d, "grad_bf16")
    assert (fp32["label"], bf16["label"]) == ("lion-grad-fp32", "lion-grad-bf16")
    assert float(bf16["bytes_sent_per_step"]) == pytest.approx(float(fp32["bytes_sent_per_step"]) / 2, rel=1e-3)
    assert float(bf16["bytes_sent_per_step"]) > 0


@pytest.mark.parametrize("name", ["lion", "adamw"])
def test_harness_optimizer_paths(runs, name):
    d, _ = runs
    row = summary(d, name)
    assert (row["label"], row["optimizer"], row["vote"]) == (name, name, "grad(harness)")
    steps = records(d, name)
    assert [r["n_collectives"] for r in steps] == [1] * 4
    # one fp32 allreduce of every parameter: ring bytes 2 (P-1)/P * n * 4
    assert steps[0]["bytes_sent"] == pytest.approx(2 * (WORLD - 1) / WORLD * int(row["params"]) * 4)
    assert all(0 < r["loss"] < 10 for r in steps)
    assert losses(d, "lion") != losses(d, "adamw")


def test_outer_rule_changes_the_rounds(runs):
    d, _ = runs
    nesterov, sgd, lion = (losses(d, f"outer_{k}") for k in ("nesterov", "sgd", "lion"))
    # local steps are on: the inner steps are each rank's own, not the allreduced-gradient run's
    assert summary(d, "outer_sgd")["label"] == "lion-grad-fp32-h2"  # not the baseline's 'lion-grad-fp32'
    assert nesterov[0] == losses(d, "grad_fp32")[0] and nesterov[1:] != losses(d, "grad_fp32")[1:]
    assert nesterov[:2] == sgd[:2] == lion[:2]  # the first round's inner steps are the same
    assert len({tuple(nesterov[2:]), tuple(sgd[2:]), tuple(lion[2:])}) == 3  # then each outer step differs


def test_local_steps_vote_auto_without_alpha_beta_through_the_cli(runs):
    d, _ = runs
    assert summary(d, "local_auto")["label"] == "lioncub-auto-h2-vote"
    steps = records(d, "local_auto")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(0 < r["loss"] < 10 for r in steps)
    assert steps[1]["bytes_sent"] > 0 and steps[3]["bytes_sent"] > 0  # the vote ran at each round's end


def test_local_steps_auto_and_the_scatter_mean_through_the_cli(runs):
    d, _ = runs
    row = summary(d, "steps_auto")
    assert row["label"] == "lioncub-onebit-2b-hauto-mean"
    H = int(row["local_steps_picked"])
    assert 1 <= H <= 500 and float(row["step_s"]) > 0 and float(row["round_s"]) > 0
    steps = records(d, "steps_auto")
    rounds = [r["step"] for r in steps if r["bytes_sent"] > 0]  # the exchanges: round ends only
    assert rounds[0] == 10 and rounds == list(range(10, rounds[-1] + 1, H)) and steps[-1]["step"] >= 16
    assert steps[-1]["step"] == rounds[-1]  # the run stops at a round's end


def test_eager_reaches_localcub_and_moves_each_replica_while_its_round_flies(runs):
    """--eager: the LocalCub the run steps has eager=True (its own settings, saved in the checkpoint), and at the
    first round's end each replica takes the outer rule's step by its own Δ_i where the plain streamed run keeps
    θ_i (nothing in flight yet): the first two losses alike, the third not."""
    import torch

    d, _ = runs
    assert summary(d, "stream")["label"] == "lion-grad-fp32-h2-streaming"
    assert summary(d, "eager")["label"] == "lion-grad-fp32-h2-streaming-eager"
    stream, eager = losses(d, "stream"), losses(d, "eager")
    assert eager[:2] == stream[:2] and eager[2] != stream[2], (stream, eager)
    for name, want in (("stream", None), ("eager", True)):
        for rank in range(WORLD):
            saved = torch.load(d / name / "ckpt" / "step_0000004" / f"rank{rank}.pt", weights_only=False)["optimizer"]
            envelope = saved["local"]  # LocalCub.state_key: its kind and settings (fingerprint)
            assert envelope["kind"] == "LocalCub" and envelope["config"]["delay"] == 1, envelope["config"]
            assert envelope["config"].get("eager") is want, (name, envelope["config"])


@pytest.mark.parametrize("extra, message", [
    (["--vote", "grad", "--eager"], "eager=True apply to local_steps > 1 only"),
    (["--local-steps", "2", "--vote", "grad", "--eager"],
     "eager=True stands in for an agreement in flight: it needs delay=1"),
    (["--local-steps", "2", "--vote", "sign_allreduce", "--error-feedback", "--delay", "1", "--eager"],
     "eager=True stands in this worker's own Δ for the agreed mean: it needs a mean"),
])
def test_eager_where_it_cannot_apply_is_one_line_before_any_worker_starts(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--out", str(tmp_path / "run"), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run's directory (and any worker)


def test_eager_race_rows_build_an_eager_localcub():
    """bench/race.py's ``-eager`` rows (lioncub.baselines): the name reaches LocalCub(eager=True); ``-eager``
    without a mean, or without ``-stream``, is refused."""
    import torch

    from lioncub import baselines

    model = torch.nn.Linear(4, 4)
    for name, eager in (("lcub-smean4-h4-nest0.7-ef-adamw-stream-f2-eager", True),
                        ("lcub-grad-h2-nest0.7-stream-eager", True), ("lcub-grad-h2-nest0.7-stream", False)):
        opt = baselines.build(name, model, lr=1e-3).opt
        assert opt.eager is eager and opt.delay == 1, name
    with pytest.raises(ValueError, match="eager=True stands in this worker's own Δ for the agreed mean"):
        baselines.build("lcub-pbit4-h2-nest0.7-ef-stream-eager", model, lr=1e-3)  # a sign vote
    with pytest.raises(ValueError, match="method must be one of"):
        baselines.build("lcub-grad-h2-nest0.7-eager", model, lr=1e-3)  # -eager only after -stream


def test_checkpoint_records_every_flag(runs):
    d, _ = runs
    meta = json.loads((d / "recorded" / "ckpt" / "step_0000004" / "meta.json").read_text())
    config = meta["config"]
    want = dict(betas=[0.8, 0.95], dropout=0.1, eval_batches=2, grad_dtype="bf16", log_every=2, lr_embed=2e-3,
                lr_head=4e-3, name="everything", seed=7, tied_embeddings=False, warmup_steps=3, weight_decay=0.5)
    assert {k: config[k] for k in want} == want
    assert meta["label"] == "everything" == summary(d, "recorded")["label"]
    assert [r["step"] for r in records(d, "recorded")] == [2, 4]


def test_auto_pick_local_cub_calibrates_and_gamma_changes_lion_cub_pick():
    results = run_workers(_auto_picks, WORLD)
    r = results[0]
    assert r["alpha"] > 0 and r["beta"] > 0  # measured: no alpha/beta given
    assert r["local"][0] in r["candidates"] and r["rounds"] == 1 and r["sent"] > 0
    assert r["plain"][0] in r["candidates"] and r["priced"][0] in r["candidates"]
    assert r["priced"][0] != r["plain"][0]  # gamma made the default pick the dearest
    for key in ("local", "plain", "priced"):  # every rank runs rank 0's pick
        assert results[1][key] == r[key], key


def test_plot_title_changes_the_png(runs, tmp_path):
    import matplotlib.image

    d, _ = runs
    plain, titled = tmp_path / "plain.png", tmp_path / "titled.png"
    assert main(["plot", str(d / "base"), str(d / "seed"), "-o", str(plain)]) == 0
    assert main(["plot", str(d / "base"), str(d / "seed"), "-o", str(titled), "--title", "Seeds compared"]) == 0
    for png in (plain, titled):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    a, b = matplotlib.image.imread(plain), matplotlib.image.imread(titled)
    assert a.shape == b.shape and not np.array_equal(a, b)  # the suptitle is drawn


def test_bench_dispatches_each_script(monkeypatch):
    calls = []

    def fake_run(cmd, env=None, **kw):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert cli.bench_root() == root
    for which, module in (("net", "step_time"), ("probe", "net_probe"), ("votes", "vote_bench")):
        assert main(["bench", which, "--", "--reps", "1"]) == 0
        cmd, env = calls[-1]
        # the "--" separator is dropped; the module is bench/'s, run as bench/README.md runs it
        assert cmd == [sys.executable, "-m", f"bench.{module}", "--reps", "1"]
        assert os.path.isfile(os.path.join(root, "bench", f"{module}.py"))
        assert env["PYTHONPATH"].split(os.pathsep)[:2] == [root, os.path.join(root, "src")]


def test_bench_outside_a_source_checkout_is_one_error(monkeypatch, capsys, tmp_path):
    installed = tmp_path / "site-packages" / "lioncub"
    (tmp_path / "bench").mkdir()  # where a checkout keeps bench/: here a folder without the package
    monkeypatch.setattr(cli, "__file__", str(installed / "cli.py"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a script without a checkout"))
    assert cli.bench_root() is None
    assert main(["bench", "votes"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1  # one line
    assert out.err.startswith("lioncub bench: needs a source checkout") and str(installed) in out.err
