"""``lioncub`` command line: a thin dispatcher, one function pair per subcommand.

    lioncub train [flags]      train (default: Lion fp32 vs LionCub vs LocalCub on Shakespeare, 4 workers,
                               behind emulated 100 Mbit/s links when root)
    lioncub prepare [--data]   tokenise a text corpus into train.bin/val.bin
    lioncub plot RUN_DIR...    overlay runs' loss curves into one PNG
    lioncub analyze [flags]    the paper's instruments (c, sign match, momentum spread, ties) on a small GPT
    lioncub bench net|probe|votes [ARGS]  step-time table / net probe / vote costs (bench/)
    lioncub env                what this machine offers: versions, backends, fused loops, testbed

To add a subcommand: write ``_add_NAME(subparsers)`` (which sets ``func``) and
``cmd_NAME(args) -> int``, and list ``_add_NAME`` in ``_SUBCOMMANDS``. Heavy
imports stay inside the ``cmd_`` functions (the harness, matplotlib) so other subcommands do not pay for them.
"""
from __future__ import annotations

import argparse
import os
import sys

from .aggregations import AGGREGATIONS
from .ft.command import _FT_KEYS, cmd_train_ft
from .harness.config import aggregation_fields
from .optim.auto_steps import MAX_LOCAL_STEPS
from .optim.outer import OUTER_RULES
from .options import PACES
from .votes.mean import AGGREGATES as STEP_AGGREGATES
from .votes.rounds import ROUND_AGGREGATES
from .testbed import TESTBED_SWITCH, testbed_unavailable
from .testbed.straggler import add_arguments as add_straggler_arguments, parse_flags as parse_straggler_flags
from .harness.config import RECOMMENDED, DEVICES, MODELS, MOMENTUM_SYNCS, NONFINITE, OPTIMIZERS, QUANTIZERS, VOTES, TrainConfig


def _local_steps(text: str):
    """``--local-steps``: an int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None

def _add_train(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="train a model data-parallel (default: Lion vs Lion Cub side by side)",
                       description="Train with Lion / Lion Cub / AdamW on local workers (--nproc) or under "
                       "torchrun. With neither --optimizer nor --vote, runs the comparison: Lion's fp32 gradient "
                       "allreduce (vote='grad'), LionCub every step at README's recommendation (the 1-bit mean: "
                       "--vote onebit --aggregate mean) and LocalCub at the settings "
                       "bench/README.md's race recommends, for --budget seconds each, behind emulated "
                       f"{DEFAULT_LINK} links when root; prints the time each took to Lion's final loss, the "
                       "per-step table, and writes loss.png. "
                       "Elastic restarts: `torchrun --max-restarts=N -m lioncub.cli train --ckpt-every K "
                       "--auto-resume ...` restarts every worker after a failure with the same arguments, and "
                       "each restart continues from --out's ckpt/latest (also on another world size).")
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--data", default=None, help="shakespeare | digits | DIR with train.bin/val.bin | FILE.txt | "
                   "FILE.npz | image folder (default: shakespeare for GPT, digits for images)")
    p.add_argument("--cache-dir", default=d.cache_dir, help="where prepared token files go (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default: {d.steps}; with --budget, or in the default comparison: a cap)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="train each run for this many seconds of training time (the slowest worker's), constant "
                   f"lr after the warm-up (default: {DEFAULT_BUDGET_S:g} in the comparison unless --steps is given)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker")
    p.add_argument("--block-size", type=int, default=d.block_size, help="GPT context length")
    p.add_argument("--vocab-size", type=int, default=None, help="GPT vocabulary (default: from the data)")
    p.add_argument("--untied", dest="tied_embeddings", action="store_false", help="untie GPT input/output embeddings")
    p.add_argument("--width", type=int, default=d.width, help="ResNet base width (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr-embed", type=float, default=None, help="learning rate of embeddings (default: --lr)")
    p.add_argument("--lr-head", type=float, default=None, help="learning rate of the output head (default: --lr)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--betas", type=float, nargs=2, default=d.betas, metavar=("B1", "B2"))
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help=f"default: {d.optimizer}")
    p.add_argument("--aggregation", choices=tuple(AGGREGATIONS), default=None,
                   help="how the update travels, the library's aggregation= (docs/api.md): every step 'onebit-mean' "
                   "(the library's default, and this command's when no --aggregation/--vote/--bits is given), "
                   "'sign-vote' (its collective: --vote), 'mean'; local steps 'scatter-mean' (the library's default, "
                   "with --bits 2), 'lane-mean', 'sign-vote', 'mean'. --bits is its code width")
    p.add_argument("--vote", choices=VOTES, default=None,
                   help=f"the vote's collective (SignVote's transport; {d.vote} where a vote is asked for without "
                   "one), or 'grad' (Mean)")
    p.add_argument("--bits", type=int, choices=(1, 2, 4, 8), default=None,
                   help="the aggregation's code width: the lanes of 'pbit' and of the lane mean (2, 4, 8), or the "
                   "scatter mean's code (1, 2, 4, 8)")
    p.add_argument("--quantizer", choices=[q for q in QUANTIZERS if q], default=None)
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"), default=d.grad_dtype)
    p.add_argument("--momentum-sync", choices=MOMENTUM_SYNCS, default=d.momentum_sync,
                   help="LionCub: momenta averaged across workers every --sync-every steps (default: %(default)s)")
    p.add_argument("--sync-every", type=int, default=d.sync_every, help="default: %(default)s")
    p.add_argument("--nonfinite", choices=NONFINITE, default=d.nonfinite,
                   help="LionCub: on a NaN/Inf gradient, raise or skip the step on every worker (default: %(default)s)")
    p.add_argument("--check-every", type=int, default=d.check_every,
                   help="LionCub: check every N steps that replicas are identical (0: never)")
    p.add_argument("--overlap", action="store_true", help="LionCub: launch votes from backward hooks")
    p.add_argument("--local-steps", type=_local_steps, default=d.local_steps, metavar="H",
                   help="LionCub: H inner steps per voted outer step (LocalCub; default: %(default)s = every step), "
                        "or 'auto': H picked from the measured link and compute (printed)")
    p.add_argument("--local-setting", choices=("given", "link"), default=d.local_setting,
                   help="local steps: 'link' runs LocalCub(aggregation='auto'), which picks its whole setting (H, "
                        "the round's code, the outer rule) from the measured link and step in its first round, with "
                        "AdamW inside at lr 4e-3 (needs --local-steps auto; in the summary, kept on resume); 'given': "
                        "the flags (default: %(default)s)")
    p.add_argument("--inner", choices=("lion", "adamw"), default=d.inner, help="local steps: inner optimizer")
    p.add_argument("--outer", choices=tuple(OUTER_RULES), default=d.outer, help="local steps: outer rule")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr, help="local steps: outer lr (default: %(default)s)")
    p.add_argument("--error-feedback", action="store_true", help="local steps: keep compression residuals")
    p.add_argument("--aggregate", choices=tuple(dict.fromkeys(STEP_AGGREGATES + ROUND_AGGREGATES)), default=d.aggregate,
                   help="'vote' (sign step) or 'mean': every step, the 1-bit mean (--vote onebit); "
                   "local steps, summed L1 lanes (--vote pbit --quantizer l1)")
    p.add_argument("--delay", type=int, choices=(0, 1), default=d.delay,
                   help="local steps: 1 streams rounds, each round's exchange overlapped with the next round's "
                   "inner steps and its outer step applied one round late (default: %(default)s)")
    p.add_argument("--fragments", type=int, default=d.fragments,
                   help="local steps with --delay 1: stream the model in this many fragments, their rounds staggered "
                   "every H/fragments steps (default: %(default)s)")
    p.add_argument("--eager", action="store_true", default=d.eager,
                   help="local steps with --delay 1 and a mean: while a round (or fragment) is in flight, the outer step "
                   "by the worker's own pseudo-gradient stands in for the agreed one")
    p.add_argument("--pace", choices=PACES, default=d.pace,
                   help="local steps: 'slowest' (every worker H steps a round, at the slowest one's pace) or 'timed' "
                   "(each worker as many steps as fit the round's time, its pseudo-gradient weighted by its steps, "
                   "so a slow worker does not set everyone's pace: docs/stragglers.md; needs --budget) "
                   "(default: %(default)s)")
    p.add_argument("--nodes", type=int, default=d.nodes,
                   help="LionCub: the workers form this many nodes of consecutive ranks; average inside a node, "
                   "vote across nodes (NodeCub; with --link, each node is one namespace behind one shaped link)")
    p.add_argument("--no-shard", dest="shard", action="store_false",
                   help="--nodes: every rank of a node votes on the whole model (default: each on its share)")
    p.add_argument("--timeout", type=float, default=d.timeout, metavar="SECONDS",
                   help="process-group timeout: how long a collective waits for a dead worker (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=d.nproc, help="local workers when not under torchrun")
    add_straggler_arguments(p, rank="worker RANK (with --ft: replica RANK)")  # --slow-worker, --pause-worker
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"evaluate every N steps (default: {d.eval_every}; with --budget: 0, and every budget/"
                   f"{EVALS_PER_BUDGET} seconds)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="continue from PATH (a checkpoint or run dir, of any world size); bare --resume: "
                   "the --out run's latest")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue from --out's ckpt/latest if there is one, else start afresh (for restarted "
                   "jobs: torchrun --max-restarts=N)")
    p.add_argument("--out", default=d.out, help="run directory (default: %(default)s)")
    p.add_argument("--name", default=None, help="run label")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="train baseline (vote=grad) and Lion Cub side by side (default: on unless "
                   "--optimizer or --vote is given)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write TensorBoard event files to DIR/LABEL (loss, lr, bytes/step, step-time split, "
                   "val loss); needs `pip install tensorboard`")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="run the --nproc workers in an emulated cluster whose links are shaped to RATE "
                   "(e.g. 1gbit, 100mbit; 'unshaped' = namespaces without shaping); needs root. 'none' = "
                   f"loopback. Default: the comparison runs behind {DEFAULT_LINK} links when this machine can "
                   f"build them (root, network namespaces; {TESTBED_SWITCH}=0 turns that off), else on loopback "
                   "with a line saying why; single runs on loopback")
    from .ft.command import add_ft_arguments

    add_ft_arguments(p)
    p.set_defaults(func=cmd_train, parser=p)


def _without_link(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--link":
            skip = True
        elif not a.startswith("--link="):
            out.append(a)
    return out


# The default comparison's link and budget: at 100 Mbit/s gpt-mini's fp32 all-reduce takes ~7x its compute
# per step on a 2-core host (r ~ 7, 429 vs 65 ms; GPUs on 1-10 Gbit/s Ethernet sit at r ~ 20-200), and three
# runs of 25 s of training each keep a fresh `make train` (its install included) within 3 minutes there.
DEFAULT_LINK = "100mbit"
DEFAULT_BUDGET_S = 25.0
EVALS_PER_BUDGET = 14
STEP_CAP = 50_000  # --budget without --steps: steps are capped at STEP_CAP * --local-steps
def loopback_note(reason: str) -> str:
    """The one line the default comparison prints when it falls back to loopback."""
    return (f"lioncub train: on loopback, not behind an emulated slow link ({reason}); Lion Cub is for slow "
            f"links: run `sudo lioncub train` (root builds a {DEFAULT_LINK} cluster) or pick a rate with "
            "--link RATE (e.g. --link 1gbit); --link none: loopback without this line")


def _train_behind_link(args, link: str) -> int:
    from .harness.launch import run_in_testbed
    from .testbed import parse_rate

    rate = None if link.lower() == "unshaped" else link
    try:
        parse_rate(rate)
    except ValueError as exc:
        args.parser.error(f"--link: {exc}")
    argv = _without_link(args.argv) + ["--link", link]  # the workers name the link in their reports
    try:
        return run_in_testbed(argv, args.nproc, rate, nodes=args.nodes if args.nodes > 1 else None)
    except RuntimeError as exc:
        args.parser.error(str(exc))


def cmd_train(args) -> int:
    try:  # the ranks are checked against the workers with the other inputs (check_inputs)
        args.slow_workers, args.pause_workers = parse_straggler_flags(args.slow_workers, args.pause_workers)
    except ValueError as exc:
        args.parser.error(str(exc))
    if args.ft or args.ft_replica is not None:
        return cmd_train_ft(args)
    compare = args.compare if args.compare is not None else (
        args.optimizer is None and args.vote is None and args.aggregation is None)
    budget = args.budget if args.budget is not None else (
        DEFAULT_BUDGET_S if compare and args.steps is None else None)
    if budget is not None and not budget > 0:
        args.parser.error(f"--budget must be > 0 seconds, got {budget:g}")
    if args.steps is None:
        args.steps = (STEP_CAP * (MAX_LOCAL_STEPS if args.local_steps == "auto" else max(1, args.local_steps))
                      if budget is not None else TrainConfig().steps)
    if args.eval_every is None:
        args.eval_every = 0 if budget is not None else TrainConfig().eval_every
    fields = {k: v for k, v in vars(args).items()
              if k not in ("func", "parser", "compare", "command", "link", "argv", "budget") + _FT_KEYS}
    fields["time_budget"] = budget
    fields["eval_every_s"] = budget / EVALS_PER_BUDGET if budget is not None else 0.0
    fields["optimizer"] = fields["optimizer"] or "lioncub"
    try:
        fields.update(aggregation_fields(fields.pop("aggregation"), args, local=args.local_steps != 1))
    except ValueError as exc:
        args.parser.error(str(exc))
    fields["vote"] = fields["vote"] or "pbit"
    if fields["optimizer"] == "lioncub" and (args.vote, args.aggregation, args.bits, args.quantizer, args.aggregate,
                                             args.local_steps, args.nodes) == (None, None, None, None, "vote", 1, 1):
        fields.update(RECOMMENDED)  # every step, nothing chosen: LionCub's own default, the 1-bit mean
    fields["betas"] = tuple(fields["betas"])
    if fields["resume"] == "":
        fields["resume"] = fields["out"]
    if compare and (fields["resume"] is not None or fields["auto_resume"]):
        args.parser.error("--resume/--auto-resume apply to a single run; add --no-compare (or --optimizer/--vote)")
    try:
        config = TrainConfig(**fields)
    except ValueError as exc:
        args.parser.error(str(exc))
    if config.resume:  # a missing, incomplete or corrupt checkpoint is the user's to fix: say which file
        from .harness.checkpoint import find_checkpoint, verify_checkpoint

        try:
            verify_checkpoint(find_checkpoint(config.resume))
        except ValueError as exc:
            args.parser.error(f"--resume: {exc}")
    from .harness.compare import variants
    from .harness.train import check_inputs

    torchrun = "RANK" in os.environ
    try:  # before any worker starts: what a user can fix is one line, not a worker's traceback
        for variant in variants(config) if compare else [config]:
            check_inputs(variant, int(os.environ.get("WORLD_SIZE", config.nproc)), prepare=not torchrun)
    except ValueError as exc:
        args.parser.error(str(exc))
    link = args.link
    if not torchrun:  # not yet inside the testbed (or torchrun): where to run
        if link is None and compare:
            reason = testbed_unavailable()
            if reason is None:
                link = DEFAULT_LINK
            else:
                print(loopback_note(reason), flush=True)
        if link is not None and link.lower() != "none":
            return _train_behind_link(args, link)
    link = None if link is None or link.lower() == "none" else link.lower()
    if compare:
        from .harness.compare import run_compare

        run_compare(config, link=link)
        return 0
    from .harness.train import run

    summary = run(config)
    if summary is not None and int(os.environ.get("RANK", 0)) == 0:
        from .harness.compare import format_table

        print(format_table([summary]))
        print(f"\nwrote {config.out}/metrics.jsonl and {config.out}/summary.csv")
    return 0


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise a text corpus into train.bin/val.bin (byte-level)")
    p.add_argument("--data", default="shakespeare", help="shakespeare | FILE.txt")
    p.add_argument("--out", default=None, help="output directory (default: the cache dir's entry)")
    p.add_argument("--cache-dir", default=TrainConfig().cache_dir)
    p.set_defaults(func=cmd_prepare, parser=p)


def cmd_prepare(args) -> int:
    from .harness.data.text import prepare, prepared_dir, read_meta

    out = args.out or prepared_dir(args.data, args.cache_dir)
    try:
        prepare(args.data, out)
    except ValueError as exc:
        args.parser.error(str(exc))
    except OSError as exc:
        args.parser.error(f"--out {out!r}: cannot write there ({exc.strerror})")
    meta = read_meta(out)
    print(f"wrote {out}/train.bin ({meta['train_tokens']:,} tokens) and val.bin ({meta['val_tokens']:,} tokens)")
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="overlay runs' loss curves (loss vs step and vs time) in one PNG")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.jsonl")
    p.add_argument("-o", "--output", default="loss.png", help="PNG to write (default: %(default)s)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_plot, parser=p)


def cmd_plot(args) -> int:
    from .harness.plot import plot_runs

    try:
        print(f"wrote {plot_runs(args.runs, args.output, title=args.title)}")
    except ValueError as exc:
        args.parser.error(str(exc))
    except OSError as exc:
        args.parser.error(f"--output {args.output!r}: cannot write there ({exc.strerror})")
    return 0


def _add_analyze(sub) -> None:
    from .harness.analyze import add_arguments

    p = sub.add_parser("analyze", help="the paper's instruments on a small GPT (writes instruments.json, CSVs, PNGs)",
                       description="Train a small GPT with LionCub on local gloo workers and measure what the "
                       "paper's figures show: the distribution of c, sign match per quantizer and bit width, "
                       "momentum spread across workers, tie rates; then a run with momentum_sync='adaptive'.")
    add_arguments(p)
    p.set_defaults(func=cmd_analyze, parser=p)


def cmd_analyze(args) -> int:
    from .harness.analyze import config_from_args, main_run

    try:
        config = config_from_args(args)
    except ValueError as exc:
        args.parser.error(str(exc))
    return main_run(config)


_BENCH_SCRIPTS = {"net": "step_time", "probe": "net_probe", "votes": "vote_bench"}  # modules of bench/


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks from a source checkout's bench/ (net needs root)",
                       description="net: the step-time table on an emulated 1 Gbit/s cluster and unshaped "
                       "(bench/step_time.py); probe: allreduce time and wire bytes vs the ring model "
                       "(bench/net_probe.py); votes: per-method vote cost on loopback (bench/vote_bench.py). "
                       "Remaining arguments go to the script (e.g. `lioncub bench net -- --rates 1gbit`). "
                       "bench/ ships with the sources, not with the installed package.")
    p.add_argument("which", choices=tuple(_BENCH_SCRIPTS))
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=cmd_bench, parser=p)


def bench_root() -> str | None:
    """The source checkout this lioncub runs from (the directory holding bench/ and src/), or None
    for an installed package (bench/ is not part of it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "bench", "__init__.py")) else None


def cmd_bench(args) -> int:
    import subprocess

    root = bench_root()
    if root is None:
        print(f"lioncub bench: needs a source checkout (bench/ beside src/; this lioncub is installed at "
              f"{os.path.dirname(os.path.abspath(__file__))}): clone the Lion Cub repository, `pip install -e .` "
              "there and run lioncub bench from it", file=sys.stderr)
        return 2
    extra = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "src"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", f"bench.{_BENCH_SCRIPTS[args.which]}"] + extra, env=env).returncode


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="what this machine offers Lion Cub: versions, backends, fused loops, testbed",
                       description="Prints one line per item; include it when reporting a problem. The fused "
                       "CPU loops line says why the (slower) torch path runs when it does.")
    p.set_defaults(func=cmd_env, parser=p)


def env_report() -> list[tuple[str, str]]:
    """(item, value) rows of ``lioncub env``."""
    import platform

    import torch
    import torch.distributed as dist

    from . import __version__, fused, testbed

    cuda = "no"
    if torch.cuda.is_available():
        cuda = f"{torch.cuda.device_count()} device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    return [
        ("lioncub", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("platform", platform.platform()),
        ("torch threads", f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"),
        ("gloo", "yes" if dist.is_gloo_available() else "no"),
        ("nccl", "yes" if dist.is_nccl_available() else "no"),
        ("cuda", cuda),
        ("fused CPU loops", fused.status()),
        ("slow-link testbed", testbed.check_available() or "ready (root, ip, tc): lioncub train --link RATE"),
    ]


def cmd_env(args) -> int:
    rows = env_report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:{width}s}  {v}")
    return 0


_SUBCOMMANDS = [_add_train, _add_prepare, _add_plot, _add_analyze, _add_bench, _add_env]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lioncub", description="Lion Cub: communication-efficient distributed Lion")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

