"""Time to loss: Lion Cub against what users would pick instead, on an emulated slow network (issue 9).

Every method in :mod:`lioncub.baselines` trains the same GPT on the same byte-level
Shakespeare shards, 4 workers inside a :class:`lioncub.testbed.Testbed` (tbf 1 Gbit/s up
and down per worker), for the same wall-clock budget of *training* time (evaluations
are not counted), once per learning rate of its family's grid (``--lr-adamw`` /
``--lr-lion``: the same 2-3 point sweep for every method of a family) and per seed
(``--seeds``: model init and data order). After a ``--warmup``-step linear warm-up the
learning rate is constant (``--schedule constant``) or follows a cosine to ``--min-lr-ratio``
of the peak over the budget (``--schedule cosine``: over the agreed training seconds, or over
``--steps``); weight decay 0; betas (0.9, 0.99).

With several seeds a method's best lr is the one with the lowest mean final loss over the seeds
all its lrs ran (the tuning seed, when later seeds ran at the best lr only); its row
gives the mean ± std over seeds of the final loss and of the time and bytes to each target
(and how many seeds reached it), and the plot its mean curve with a band of ± one std. ``lcub-link`` (no
``@LR``) is ``LocalCub(local_steps='auto', aggregation='auto')``, which picks its setting from the link in its
first round (:mod:`lioncub.optim.regime`), at the lr its low-bit rounds were raced at; each run's pick is in the
JSON (``setting``).

Each run is the harness's training loop (:class:`lioncub.harness.loop.Loop`, what ``lioncub train``
runs); the Lion Cub rows are built by the harness's optimizer factory (``cub_config``), the peers by
:func:`lioncub.baselines.build`. At each point where the replicas agree (every step; every H steps for
local SGD, DiLoCo and SparseLoCo) the ranks agree on the elapsed time (one 8-byte all-reduce, MAX: each
rank's seconds of steps since the last such point, evaluations not counted) and, every
``--eval-every`` seconds, evaluate the agreed model on fixed validation batches. Each
evaluation records: training seconds, steps, validation loss, bytes this rank's veth
sent so far (mean over ranks). Each run also records every step's seconds on rank 0 (``step_s``,
evaluations taken out): where a method's time goes (a round's step against an inner one). The target
is the loss Lion + DDP fp32 (best LR) reaches at the end of its budget; the table gives each method's
time and bytes to reach it (the report: :mod:`bench.race_report`).

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.race                  # ~21 min
    ... -m bench.race --methods lioncub-onebit,lioncub-onebit-overlap --append bench/results/race.json
    ... -m bench.race --budget 20 --methods lion-ddp,lioncub-pbit4 --lr-lion 3e-4   # a quick look
    ... -m bench.race --rate 10mbit --budget 100 --methods lcub-link --slow-worker 1:1.5  # one worker 1.5x slower
    ... -m bench.race --rate 10mbit --methods lcub-link --reference-loopback adamw-ddp@2e-3  # x DDP on a fast net

``--reference-loopback METHOD@LR`` runs that method (the job a user would otherwise run, on a fast network) after
the race in the same invocation with the link unshaped, for the same seeds and budget, and records the host's load
around it; the report's headline column is each row's time to that reference's loss at half the budget, over the
reference's own time to it (``x DDP-loopback``: 1.0 is as soon as DDP on a fast network).

``--slow-worker RANK:FACTOR`` / ``--pause-worker RANK:S:T`` (:mod:`lioncub.testbed.straggler`, docs/stragglers.md)
make one worker a straggler in every run; each run's record holds every rank's compute and sleep (``straggler``).

Default model: GPT 2 layers x 192 wide (0.95M parameters), 1 sequence of 32 bytes per
worker per step. Communication-bound at 1 Gbit/s on 2 CPU cores: an fp32 gradient
all-reduce sends 5.7 MB per worker per step, and a step of the methods that send
every step takes 2-3x as long as one that (almost) never sends (DiLoCo H=50).
Writes bench/results/race.json and bench/results/race.png. Needs root (namespaces, tc).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from bench import _runner
from bench.race_report import report
from bench.regime import REFERENCE, measure_compute, measure_regime
from lioncub.harness.schedule import cosine_factor, warmup_factor
from lioncub.testbed import straggler as stragglers

DEFAULT_METHODS = ("adamw-ddp,adamw-bf16,adamw-psgd-r1,adamw-psgd-r4,local-adamw-h10,diloco-h10,diloco-h50,"
                   "lion-ddp,lioncub-pbit4,lioncub-pbit4-overlap")


LINK = "lcub-link"
"""LocalCub's whole setting picked from the link measured in the run (``aggregation='auto'``,
:mod:`lioncub.optim.regime`): H, the outer rule, the round's code. Named without ``@LR``: its lr is
:data:`~lioncub.optim.regime.AUTO_LR`."""


def _runs(args) -> list[tuple[str, float | None, int]]:
    from lioncub import baselines

    grids = {"adamw": [float(v) for v in args.lr_adamw.split(",")],
             "lion": [float(v) for v in args.lr_lion.split(",")]}
    seeds = [int(s) for s in str(args.seeds).split(",")]
    out = []
    for seed in seeds:
        for m in args.methods.split(","):
            name, _, own = m.partition("@")  # name@lr: this method at its own lr, not its family's grid
            if name == LINK:
                if own:
                    raise ValueError(f"--methods: {LINK} takes its lr from the setting (the lr its rounds were raced at); "
                                     f"drop '@{own}'")
                out.append((name, None, seed))
                continue
            baselines.options(name)  # an unknown name fails here, before any namespace exists (with @LR too)
            for lr in ([float(own)] if own else grids[baselines.family(name)]):
                out.append((name, lr, seed))
    return out


def lr_factor(step: int, progress: float, warmup: int, schedule: str, floor: float) -> float:
    """The multiplier of the peak lr: linear warm-up over ``warmup`` steps, times 1 (``constant``)
    or a cosine from 1 to ``floor`` as ``progress`` (the fraction of the budget spent) goes 0 -> 1
    (the harness's :mod:`~lioncub.harness.schedule` factors)."""
    return warmup_factor(step, warmup) * (1.0 if schedule == "constant" else cosine_factor(progress, floor))


def _evaluate(model, val) -> float:
    """The agreed model's mean validation loss over every rank's batches (the harness's evaluation)."""
    from lioncub.harness.train import evaluate

    return evaluate(model, val, is_gpt=True)["val_loss"]


def cub_config(name: str, lr: float, seed: int):
    """The harness configuration (:class:`~lioncub.harness.config.TrainConfig`) of a Lion Cub race row, so that
    the row is built by the harness's factory (what ``lioncub train`` runs); None for a peer, and for the
    ``-overlap`` rows, whose buckets of 2 MiB the harness does not set (they stay on ``lioncub.baselines``)."""
    from lioncub import baselines
    from lioncub.baselines import cub
    from lioncub.baselines.ddp import BETAS
    from lioncub.harness.config import TrainConfig

    common = dict(optimizer="lioncub", lr=lr, betas=BETAS, weight_decay=0.0, seed=seed)
    if name == LINK:  # LocalCub(local_steps='auto', aggregation='auto'), as lioncub train --local-setting link
        from lioncub.harness.regime import resolve_setting

        return resolve_setting(TrainConfig(local_steps="auto", local_setting="link", steps=10, eval_every=0, **common))
    cls, kw = baselines.options(name)
    if cls is cub.CubMethod and not kw.get("overlap"):
        return TrainConfig(vote=kw["vote"], bits=kw.get("bits"), **common)
    if cls is cub.LocalCubMethod:  # steps and eval_every: multiples of H, unused by the factory
        H = kw.pop("H")
        return TrainConfig(local_steps=H, steps=H if H != "auto" else 10, eval_every=0, **kw, **common)
    return None


def build_method(name: str, model, lr: float, seed: int):
    """The race's method ``name``: a Lion Cub row from the harness's factory (:func:`cub_config`), a peer from
    :func:`lioncub.baselines.build`."""
    from lioncub import baselines
    from lioncub.harness.method import make_method
    from lioncub.harness.models import param_groups

    config = cub_config(name, lr, seed)
    if config is None:
        return baselines.build(name, model, lr=lr)
    method = make_method(config, model, param_groups(model, lr=lr, weight_decay=0.0))
    method.name = name
    return method


def setup(args, seed: int, data_dir: str):
    """This rank's (GPT, training loader, fixed validation batches) of a run: ``seed`` for the init and the
    data order."""
    import torch
    import torch.distributed as dist

    from lioncub.harness.data.text import TokenLoader, eval_batches
    from lioncub.harness.models.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, vocab_size=256,
                          block_size=args.block))
    loader = TokenLoader(os.path.join(data_dir, "train.bin"), block_size=args.block, batch_size=args.batch,
                         rank=rank, world_size=world, seed=seed)
    val = list(eval_batches(os.path.join(data_dir, "val.bin"), block_size=args.block, batch_size=16,
                            n_batches=args.eval_batches, rank=rank, world_size=world))
    return model, loader, val


def train_one(args, name: str, lr: float, seed: int, data_dir: str, first: bool = False) -> dict:
    """One (method, lr, seed) run on this rank for ``args.budget`` seconds of training time (or ``args.steps``
    steps), through the harness's loop (:class:`lioncub.harness.loop.Loop`). The regime r is measured before the
    reference's runs, and before the ``first`` run of the race with ``--regime``."""
    import torch.distributed as dist

    from lioncub.harness.loop import Loop
    from lioncub.testbed import iface_bytes

    dev = os.environ["GLOO_SOCKET_IFNAME"]
    model, loader, val = setup(args, seed, data_dir)
    n_params = sum(p.numel() for p in model.parameters())
    regime = measure_regime(model, loader, n_params) if name == REFERENCE or (first and args.regime) else None
    compute_s = measure_compute(model, loader)  # every run: the compute-bound step rate it is held against
    if name == LINK:  # the lr its low-bit rounds were raced at; the setting is picked in its first round
        from lioncub.optim.regime import AUTO_LR

        lr = AUTO_LR
    method = build_method(name, model, lr, seed)
    dist.barrier()
    tx0 = iface_bytes(dev)["tx"]
    evals, recent, status = [], [], "ok"
    step_s, clock = [], dict(last=time.perf_counter(), held=0.0)  # each step's seconds, evaluations taken out
    slow, pause = getattr(args, "slow_workers", ()), getattr(args, "pause_workers", ())  # (a caller's Namespace)
    straggler = (stragglers.Straggler.for_rank(dist.get_rank(), slow, pause)
                 if slow or pause else None)  # --slow-worker, --pause-worker
    trained = dict(s=0.0)

    def scores() -> dict:  # the bytes sent so far, read before the evaluation's own all-reduce
        t0 = time.perf_counter()
        out = {"tx": iface_bytes(dev)["tx"] - tx0, "val": _evaluate(model, val)}
        clock["held"] += time.perf_counter() - t0
        return out

    def on_step(info) -> None:
        now = time.perf_counter()
        step_s.append(round(now - clock["last"] - clock["held"], 5))
        clock.update(last=now, held=0.0)
        recent.append(float(info.loss))
        trained["s"] = info.train_time

    def on_eval(rec: dict) -> bool:
        nonlocal status
        evals.append(dict(t=rec["clock"], step=rec["step"], val=rec["val"], tx=rec["tx"] if evals else 0,
                          train=sum(recent) / len(recent) if recent else float("nan")))
        recent.clear()
        if not math.isfinite(rec["val"]) or rec["val"] > evals[0]["val"] + 1.0:  # agreed: val is all-reduced
            status = "diverged"
        return status != "ok"

    def lr_at(step: int, clock: float) -> float:  # progress: the step count, or the agreed clock's share
        progress = step / args.steps if args.steps is not None else clock / args.budget
        return lr * lr_factor(step, progress, args.warmup, args.schedule, args.min_lr_ratio)

    loop = Loop(lr=lr_at, steps=args.steps, budget=args.budget, eval_every_s=args.eval_every, eval_at_start=True,
                on_step=on_step, on_eval=on_eval, straggler=straggler)
    clock["last"] = time.perf_counter()
    loop.run(method, loader, scores)
    pick = getattr(getattr(method, "opt", None), "steps_pick", None)  # local_steps='auto': the H it picked
    if pick and pick.get("setting") and dist.get_rank() == 0:
        from lioncub.optim.regime import setting_text

        print(f"{name} seed {seed}: {setting_text(pick)}", flush=True)
    del method
    dist.barrier()
    return dict(method=name, lr=lr, seed=seed, status=status, n_params=n_params, steps=evals[-1]["step"], evals=evals,
                compute_s=compute_s, step_s=step_s, **({"regime": regime} if regime else {}), **({"steps_pick": pick} if pick else {}),
                **({"setting": pick["setting"]} if pick and pick.get("setting") else {}),
                **({"straggler": dict(straggler.totals(), train_s=trained["s"])} if straggler else {}))


def worker(args) -> None:
    """One rank: every (method, lr, seed) in turn, each run's record appended as it finishes."""
    import torch.distributed as dist

    rank = _runner.init_worker(timeout_s=300)
    with open(_runner.rank_file(args.out_dir, rank, "jsonl"), "a") as f:
        for i, (name, lr, seed) in enumerate(_runs(args)):
            f.write(json.dumps(train_one(args, name, lr, seed, args.data_dir, first=i == 0)) + "\n")
            f.flush()  # a later crash keeps the runs done so far
    dist.destroy_process_group()


# ---------------------------------------------------------------------- report
def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's records with ``tx`` replaced by the mean over ranks (and ``straggler`` by every rank's, in rank
    order)."""
    out = []
    for recs in zip(*per_rank):
        run = dict(recs[0])
        run["evals"] = [dict(e, tx=sum(r["evals"][i]["tx"] for r in recs) / len(recs))
                        for i, e in enumerate(recs[0]["evals"])]
        if "straggler" in run:
            run["straggler"] = [r["straggler"] for r in recs]
        out.append(run)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma list of lioncub.baselines.METHODS; "
                    "NAME@LR runs that method at LR only (else at its family's --lr-* grid)")
    ap.add_argument("--lr-adamw", default="1e-3,3e-3", help="AdamW-family learning rates (DDP, local, DiLoCo inner)")
    ap.add_argument("--lr-lion", default="3e-4,1e-3", help="Lion-family learning rates (Lion DDP, Lion Cub)")
    ap.add_argument("--budget", type=float, default=50.0, help="training seconds per run")
    ap.add_argument("--steps", type=int, help="end each run at its first sync point at or after this many steps "
                    "instead of after --budget seconds (a step-matched grid; wall time does not decide it)")
    ap.add_argument("--eval-every", type=float, default=5.0, help="training seconds between evaluations")
    ap.add_argument("--eval-batches", type=int, default=2, help="validation batches (16 sequences) per worker")
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="after the warm-up: constant, or a cosine over the budget (seconds, or --steps)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine: the last lr, as a fraction of the peak")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--regime", action="store_true", help="measure r before the race's first run too (it is "
                    "always measured before the reference's, lion-ddp, runs)")
    ap.add_argument("--rate", default="1gbit", help="per-direction link rate; 'none' = unshaped")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=192)
    ap.add_argument("--block", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per worker per step")
    ap.add_argument("--seeds", default="0", help="comma list: every (method, lr) runs once per seed")
    ap.add_argument("--target", default=REFERENCE, help="the method whose final loss (and half-budget loss) are the "
                    "targets A and B (default: %(default)s; where it is hopeless, the best peer)")
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "race.json"))
    ap.add_argument("--append", metavar="JSON", help="keep the runs of an earlier race.json (a later run of the "
                    "same method and lr replaces it) and report them together")
    ap.add_argument("--report-only", metavar="JSON", help="re-make the table and plot of a race.json; run nothing")
    ap.add_argument("--reference-loopback", metavar="METHOD@LR", help="after the race, in the same invocation, run "
                    "METHOD@LR (e.g. adamw-ddp@2e-3: the job a user would run on a fast network) with the link "
                    "unshaped, for the same seeds; the report's headline column is each row's time to that "
                    "reference's loss at half the budget, as a multiple of the reference's own time")
    stragglers.add_arguments(ap)
    _runner.add_worker_args(ap)
    ap.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.slow_workers, args.pause_workers = stragglers.parse_flags(args.slow_workers, args.pause_workers,
                                                                       world=args.workers)
    except ValueError as exc:
        ap.error(str(exc))
    if args.steps is not None:
        if args.steps < 1:
            ap.error(f"--steps must be >= 1, got {args.steps}")
        args.budget = float("inf")
    if args.worker:
        worker(args)
        return 0
    if args.report_only:
        return report(args.report_only)
    from lioncub.harness.config import default_cache_dir
    from lioncub.harness.data.text import ensure_prepared

    try:  # unknown method names fail here, before any namespace exists
        _runs(args)
        if args.reference_loopback is not None:
            name, at, lr = args.reference_loopback.partition("@")
            if "," in args.reference_loopback or not at or name == LINK:
                ap.error(f"--reference-loopback takes one METHOD@LR, got {args.reference_loopback!r}")
            _runs(argparse.Namespace(**dict(vars(args), methods=args.reference_loopback)))
    except ValueError as exc:
        ap.error(str(exc))
    data_dir = ensure_prepared("shakespeare", default_cache_dir())
    load_before = os.getloadavg()
    per_run = args.budget * 3 if args.steps is None else args.steps * 2.0  # seconds before giving up
    passed = [*(sys.argv[1:] if argv is None else argv), "--data-dir", data_dir]
    ran = _runner.launch("bench.race", passed, args.workers, prefix="lct",
                         rate=None if args.rate.lower() == "none" else args.rate,
                         timeout=len(_runs(args)) * (per_run + 120), check=False, records="jsonl")
    bad = ran.failed
    if bad:
        print(f"a worker failed ({bad[0].returncode}); keeping the runs that finished:\n{bad[0].stderr[-3000:]}")
    runs = merge([r or [] for r in ran.ranks])
    load_after = os.getloadavg()  # (before the reference's runs, if any)
    loopback = None
    if args.reference_loopback is not None:  # the same job on a fast network: unshaped, same seeds, same budget
        before = os.getloadavg()
        refs = _runner.launch("bench.race", [*passed, "--methods", args.reference_loopback, "--rate", "none"],
                              args.workers, prefix="lcr", rate=None, timeout=len(_runs(args)) * (per_run + 120),
                              check=False, records="jsonl")
        if refs.failed:
            print(f"a reference worker failed ({refs.failed[0].returncode}):\n{refs.failed[0].stderr[-3000:]}")
        loopback = dict(method=args.reference_loopback, wall_s=refs.wall_s, load_avg_before=before,
                        load_avg_after=os.getloadavg(), runs=merge([r or [] for r in refs.ranks]))
    earlier = {}
    if args.append:
        with open(args.append) as f:
            earlier = json.load(f)
        new_keys = {_run_key(r) for r in runs}
        earlier["replaced_runs"] = [r for r in earlier["runs"] if _run_key(r) in new_keys]
        runs = [r for r in earlier["runs"] if _run_key(r) not in new_keys] + runs
        loopback = loopback or earlier.get("loopback")
    _runner.write_json(args.out, {"args": vars(args), "rate": ran.rate or "unshaped", "wall_s": ran.wall_s,
                                  "load_avg_before": load_before, "load_avg_after": load_after,
                                  "earlier": {k: earlier[k] for k in ("args", "wall_s", "load_avg_before",
                                                                       "load_avg_after", "replaced_runs")
                                              if k in earlier} or None,
                                  "runs": runs, "loopback": loopback})
    report(args.out)
    return 0 if not bad else 1


def _run_key(run: dict) -> tuple:
    return run["method"], run["lr"], run.get("seed", 0)


if __name__ == "__main__":
    sys.exit(main())
