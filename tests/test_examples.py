"""Each example runs as its docstring says and prints a loss that visibly falls."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import require_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("fused_loops")  # the C loops built once per run, before the workers start


def _run(args: list[str], tmp_path, min_points: int = 4, printed: list[str] | None = None) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CI="true",  # LIONCUB_CACHE: the run's (conftest)
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) >= min_points, proc.stdout
    if printed is not None:
        printed.append(proc.stdout)
    return losses


def _torchrun(example: str, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--standalone",
            os.path.join(ROOT, "examples", example)]


def _falls(losses: list[float], factor: float) -> None:
    """The last loss is well under the first, and no printed loss is above the first."""
    assert losses[-1] < factor * losses[0] and max(losses) <= losses[0], losses


def test_ddp_example_learns(tmp_path):
    _falls(_run(_torchrun("ddp_lioncub.py"), tmp_path), 0.2)


@pytest.mark.slow  # ~20 s of 4 ranks; tests/test_sharded.py checks the same paths bit for bit
def test_hsdp_example_learns_and_checkpoints(tmp_path):
    """FSDP2 inside a replica, LionCub's 1-bit vote across 2 replicas, a DCP save/load halfway."""
    printed: list[str] = []
    _falls(_run(_torchrun("hsdp_lioncub.py", ranks=4), tmp_path, printed=printed), 0.2)
    assert "across 2 replicas" in printed[0]
    assert (tmp_path / "hsdp_lioncub_checkpoint" / ".metadata").exists()


@pytest.mark.slow  # ~60 s of transformers start-up; tests/test_ddp_hook.py runs the HF Trainer with our hook
def test_hf_trainer_example_learns(tmp_path):
    require_module("transformers")
    require_module("accelerate")
    _falls(_run(_torchrun("hf_trainer_lioncub.py"), tmp_path), 0.3)


@pytest.mark.slow  # ~23 s of Lightning start-up
def test_lightning_example_sends_the_vote_and_learns(tmp_path):
    """Lightning's DDP strategy with Lion Cub's comm hook: 4-bit lanes instead of fp32 gradients."""
    require_module("lightning")
    printed: list[str] = []
    _falls(_run(_torchrun("lightning_lioncub.py"), tmp_path, printed=printed), 0.2)
    sent, collectives, fp32, same = re.search(r"vote: (\d+) B sent per step in (\d+) collectives "
                                              r"\(fp32 gradients: (\d+) B\); replicas identical: (\w+)",
                                              printed[0]).groups()
    assert 0 < int(sent) <= int(fp32) / 8 and int(collectives) >= 1 and same == "True"


@pytest.mark.slow  # ~20 s; the instruments have their own tests (tests/test_instruments.py)
def test_instruments_example_learns(tmp_path):
    """On a small word-salad corpus (Shakespeare takes a minute to tokenise and learn)."""
    import random

    words = "the quick brown fox jumps over a lazy dog while lion cubs vote by sign".split()
    rng = random.Random(0)
    (tmp_path / "words.txt").write_text(" ".join(rng.choice(words) for _ in range(20000)))
    losses = _run([sys.executable, os.path.join(ROOT, "examples", "instruments_gpt.py"), "--workers", "2",
                   "--steps", "16", "--every", "16", "--tie-every", "4", "--block-size", "16", "--no-adaptive-run",
                   "--lr", "3e-3", "--data", str(tmp_path / "words.txt"), "--cache-dir", str(tmp_path / "cache"),
                   "--out", str(tmp_path / "out")], tmp_path, min_points=3)
    _falls(losses, 0.7)
