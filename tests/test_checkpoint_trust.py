"""Checkpoints a user can trust: nothing in one can run code, and a damaged one cannot lose a run.

One real 2-worker ``lioncub train`` run writes checkpoints at steps 2 and 4; each test
damages a copy of it the way a crash, a full disk or an attacker would (truncate, delete,
flip a bit, swap in a code-running pickle with a matching checksum) and checks what
``--auto-resume`` and ``--resume`` then do.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from lioncub.cli import main
from lioncub.harness import checkpoint
from lioncub.harness.checkpoint import CheckpointError

from .test_harness_train import TINY, _env, lioncub, read_jsonl

NEWEST, OLDER = "step_0000004", "step_0000002"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    out = base / "run"
    (base / "text.txt").write_text("To be, or not to be, that is the question. " * 400)  # tokenised in no time
    lioncub("train", *TINY, "--no-compare", "--vote", "pbit", "--steps", "4", "--ckpt-every", "2", "--eval-every",
            "0", "--nproc", "2", "--data", str(base / "text.txt"), "--out", str(out), "--cache-dir", str(base / "cache"))
    return out


@pytest.fixture
def copy(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def test_meta_lists_size_and_checksum_of_every_file(run_dir):
    ckpt = run_dir / "ckpt" / NEWEST
    meta = json.loads((ckpt / "meta.json").read_text())
    assert sorted(meta["files"]) == ["model.pt", "rank0.pt", "rank1.pt"] == sorted(
        f for f in os.listdir(ckpt) if f != "meta.json")
    for name, entry in meta["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.latest_checkpoint(str(run_dir)) == str(run_dir / "ckpt" / NEWEST)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {"truncate": _truncate, "delete": os.remove, "flip_bit": _flip_bit}


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("name", ["rank1.pt", "model.pt", "meta.json"])
def test_damaged_newest_checkpoint_is_skipped_by_auto_resume_and_refused_by_resume(copy, how, name, capsys):
    newest = copy / "ckpt" / NEWEST
    DAMAGE[how](newest / name)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        checkpoint.verify_checkpoint(str(newest))
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{NEWEST}.*{name}"):
        assert checkpoint.latest_checkpoint(str(copy)) == str(copy / "ckpt" / OLDER)
    with pytest.raises(SystemExit) as exc:  # --resume of the damaged one: one line naming the file
        main(["train", *TINY, "--no-compare", "--resume", str(newest), "--out", str(copy / "next")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: --resume: {newest / name}" in err and "Traceback" not in err


def test_auto_resume_continues_from_the_newest_valid_checkpoint(copy, tmp_path):
    """End to end: the newest checkpoint half written, the run resumes from the one before."""
    _truncate(copy / "ckpt" / NEWEST / "rank0.pt")
    proc = subprocess.run([sys.executable, "-m", "lioncub.cli", "train", *TINY, "--no-compare", "--vote", "pbit",
                           "--steps", "5", "--eval-every", "0", "--nproc", "2", "--auto-resume", "--out", str(copy),
                           "--data", json.loads((copy / "ckpt" / OLDER / "meta.json").read_text())["config"]["data"],
                           "--cache-dir", str(tmp_path / "cache")], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping checkpoint {copy / 'ckpt' / NEWEST}: {copy / 'ckpt' / NEWEST / 'rank0.pt'} is truncated" in proc.stderr
    steps = [r["step"] for r in read_jsonl(copy / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4, 5]  # 1-2 kept from the first run, 3-5 trained again from step 2


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling calls exec(...): writes the marker file
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_checkpoint_file_that_would_run_code_is_refused_and_runs_nothing(copy, tmp_path, capsys):
    marker = tmp_path / "ran"
    payload = {"optimizer": {}, "evil": _RunsCode(marker)}
    evil = tmp_path / "evil.pt"
    torch.save(payload, evil)
    with open(evil, "rb") as f:  # the payload is live: an unrestricted load runs it
        torch.load(f, weights_only=False)
    assert marker.read_text() == "ran"
    marker.unlink()

    newest = copy / "ckpt" / NEWEST  # an attacker controls meta.json too: the checksum matches
    shutil.copy(evil, newest / "rank0.pt")
    meta = json.loads((newest / "meta.json").read_text())
    data = evil.read_bytes()
    meta["files"]["rank0.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["meta_sha256"] = checkpoint._meta_digest(meta)
    (newest / "meta.json").write_text(json.dumps(meta))

    with pytest.raises(CheckpointError, match=r"rank0\.pt was refused: .*could run code.*exec"):
        checkpoint.read_file(str(newest), "rank0.pt", meta)  # what load_checkpoint reads each file with
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--no-compare", "--resume", str(newest), "--out", str(copy / "next")])
    assert exc.value.code == 2 and "rank0.pt was refused" in capsys.readouterr().err
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{NEWEST}.*refused"):
        assert checkpoint.latest_checkpoint(str(copy)) == str(copy / "ckpt" / OLDER)
    assert not marker.exists()
