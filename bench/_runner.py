"""What the benchmark scripts share: worker launch, the GPT arguments and the JSON they write.

The emulated-cluster scripts (``step_time``, ``overlap``, ``nodes``, ``net_probe``, ``race``) run
the same module once per rank: the parent parses its arguments, then :func:`launch` starts
``python -m bench.<script> --worker --out-dir DIR <the parent's own arguments>`` in every rank,
inside a :class:`lioncub.testbed.Testbed` (its own free port and subnet, so two scripts never
share either) or on loopback. Each rank joins the gloo group with :func:`init_worker` and hands
its records back with :func:`finish` (``DIR/<rank>.json``); the parent gets them in rank order.

Run the scripts from the repository root as modules (``python3 -m bench.step_time``), with
``PYTHONPATH=src`` unless lioncub is installed; the workers get both on their path.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
_subnets = itertools.count()


def comma_list(kind):
    """An argparse ``type``: ``'a,b'`` -> ``[kind('a'), kind('b')]``."""
    def parse(text: str) -> list:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    return parse


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON at ``path`` (directories made), then ``wrote PATH`` on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


def write_record(out: str, record: dict, lines: list[str]) -> None:
    """``record`` as ``OUT.json`` and its table ``lines`` as ``OUT.md`` (directories made); the table on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------- the model
def read_json(path: str):
    """A JSON file, for ``--report-only JSON``: the table re-made from an earlier run."""
    with open(path) as f:
        return json.load(f)


def add_race_model_args(ap: argparse.ArgumentParser) -> None:
    """``--workers --layers --heads --embd --block --batch``: the race's workers and GPT (``bench.race``'s flags), at
    the recipe's 4 workers x 3 sequences of 64 tokens, 4 layers of width 128."""
    for flag, default in (("workers", 4), ("layers", 4), ("heads", 4), ("embd", 128), ("block", 64), ("batch", 3)):
        ap.add_argument(f"--{flag}", type=int, default=default)


def add_gpt_args(ap: argparse.ArgumentParser, *, layers: int, embd: int, vocab: int = 8192, tokens: int = 16) -> None:
    """``--layers --embd --vocab --tokens``: the GPT of :func:`gpt` (8 heads; batch 1 of ``tokens``)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--embd", type=int, default=embd, help="width (a multiple of the 8 heads)")
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--tokens", type=int, default=tokens, help="tokens per rank per step (batch 1)")


def gpt(args):
    """The GPT of ``args`` (:func:`add_gpt_args`), initialised from seed 0: the same on every rank."""
    import torch

    from lioncub.harness.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.embd, vocab_size=args.vocab,
                         block_size=args.tokens))


def tokens(args, rank: int):
    """This rank's fixed batch of ``args.tokens`` random tokens (seeded by the rank)."""
    import torch

    return torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(rank))


# ---------------------------------------------------------------------------- the workers' side
def add_worker_args(ap: argparse.ArgumentParser) -> None:
    """The hidden ``--worker --out-dir DIR`` that :func:`launch` adds to a rank's command line."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)


def init_worker(timeout_s: float = 600.0) -> int:
    """Join the launch's gloo group (one CPU thread: ranks share few cores); returns this rank."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank()


def rank_file(out_dir: str, rank: int, ext: str = "json") -> str:
    return os.path.join(out_dir, f"{rank}.{ext}")


def finish(out_dir: str, record) -> None:
    """Hand this rank's ``record`` to the parent (``out_dir/<rank>.json``) and leave the group."""
    import torch.distributed as dist

    with open(rank_file(out_dir, dist.get_rank()), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the parent's side
@dataclass
class Launched:
    """What :func:`launch` ran: where, the link's rate, its wall time, each rank's records (None
    for a rank that left none) and the ranks that exited non-zero (``check=False`` only)."""

    where: str
    rate: str | None
    rate_bps: float | None
    wall_s: float
    ranks: list
    failed: list = field(default_factory=list)


def subnet() -> str:
    """A /24 of 10.0.0.0/8 of this launch's own: from the process id and a per-process count."""
    return f"10.{100 + os.getpid() % 150}.{next(_subnets) % 254 + 1}"


def worker_env() -> dict:
    """The environment a rank starts with: the repository root (``bench``), then the caller's
    ``PYTHONPATH``, then src/ on its path."""
    path = [ROOT, os.environ.get("PYTHONPATH", ""), os.path.join(ROOT, "src")]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in path if p))


def launch(module: str, argv: list[str], workers: int, *, prefix: str, rate=None, nodes: int | None = None,
           loopback: bool = False, timeout: float = 1500.0, check: bool = True, records: str = "json") -> Launched:
    """Run ``python -m module --worker --out-dir DIR *argv`` on ``workers`` ranks; return their records.

    In a ``Testbed(workers, rate=rate, nodes=nodes, prefix=prefix)`` (needs root), or with
    ``loopback`` on 127.0.0.1 (unshaped, no root). ``records``: ``'json'`` (what each rank gave
    :func:`finish`) or ``'jsonl'`` (each rank appended lines to ``rank_file(DIR, rank, 'jsonl')``:
    a rank that failed keeps what it finished). ``check``: raise RuntimeError when a rank fails.
    """
    from lioncub.testbed import Testbed, free_port
    from lioncub.testbed.netem import parse_rate, wait_all

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-run-") as d:
        cmd = [sys.executable, "-m", module, "--worker", "--out-dir", d, *argv]
        if loopback:
            where, (rate, rate_bps) = "LOOPBACK (unshaped)", (None, None)
            env = dict(worker_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       WORLD_SIZE=str(workers), GLOO_SOCKET_IFNAME="lo")
            logs = [tempfile.TemporaryFile("w+") for _ in range(workers)]
            procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stderr=logs[r], start_new_session=True)
                     for r in range(workers)]
            wait_all(procs, timeout)
            done = []
            for p, log in zip(procs, logs):
                log.seek(0)
                done.append(subprocess.CompletedProcess(p.args, p.returncode, "", log.read()))
                log.close()
        else:
            with Testbed(workers, rate=rate, nodes=nodes, prefix=prefix, subnet=subnet(), port=free_port()) as tb:
                done = tb.run_workers([cmd] * workers, worker_env(), timeout=timeout, check=False)
            rate, rate_bps = parse_rate(rate)
            where = f"netem testbed, {workers} workers, {rate or 'unshaped'} per link"
        failed = [c for c in done if c.returncode != 0]
        if check and failed:
            r = done.index(failed[0])
            raise RuntimeError(f"worker {r} exited with {failed[0].returncode}:\n{failed[0].stderr[-4000:]}")
        ranks = [_read(rank_file(d, r, records), records) for r in range(workers)]
    return Launched(where, rate, rate_bps, time.perf_counter() - t0, ranks, failed)


def _read(path: str, kind: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()] if kind == "jsonl" else json.load(f)
