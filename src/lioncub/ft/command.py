"""``lioncub train --ft`` (the supervisor) and ``--ft-replica K`` (one replica): the command's side
of :mod:`lioncub.ft.train`, its options (:func:`add_ft_arguments`) included."""
from __future__ import annotations

import os
import sys

from ..harness.config import TrainConfig, aggregation_fields

FT_DEFAULT_BUDGET_S = 60.0
_FT_KEYS = ("ft", "replicas", "min_replicas", "kill_every", "restart_after", "heartbeat_ms", "ft_replica", "lighthouse",
            "ft_host", "ft_deadline", "ft_config", "ft_timeout", "ft_fault", "warm_spare", "ft_standby",
            "ft_stop_round", "nproc_per_replica", "ft_rank", "ft_group_port",
           "ft_ready_dir", "inside")


def add_ft_arguments(p) -> None:
    """``lioncub train``'s fault-tolerance options (the parser ``p``'s argument group)."""
    import argparse

    ft = p.add_argument_group("fault tolerance (torchft; pip install 'lioncub[ft]')")
    ft.add_argument("--ft", action="store_true",
                    help="run LocalCub (default: the comparison's LocalCub setting) as --replicas replica groups "
                    "on torchft: a lighthouse, replicas that survive a lost peer; with --kill-every, a replica is "
                    "killed on that schedule and restarted --restart-after seconds later (lioncub.ft)")
    ft.add_argument("--replicas", type=int, default=3, help="--ft: replica groups (default: %(default)s)")
    ft.add_argument("--min-replicas", type=int, default=2, help="--ft: replicas a round needs (default: %(default)s)")
    ft.add_argument("--nproc-per-replica", type=int, default=1, metavar="N",
                    help="--ft/--ft-replica: ranks per replica group, its own torch.distributed world (a node's "
                    "GPUs; the model inside: --inside); a failed rank takes its group out and the whole group "
                    "restarts and heals (default: %(default)s)")
    ft.add_argument("--inside", choices=("fsdp2", "mean"), default="fsdp2", help="--nproc-per-replica N > 1: the "
                    "model FSDP2-sharded over the group's ranks (fsdp2, the default) or whole on each, its gradients "
                    "averaged over them every step (mean: a node mean; N copies of the exchange cross the groups)")
    ft.add_argument("--kill-every", type=float, default=0.0, metavar="SECONDS",
                    help="--ft: SIGKILL a replica every SECONDS (round-robin; 0 = no failures)")
    ft.add_argument("--ft-fault", action="append", default=[], metavar="REPLICA:ROUND:POINT[:ACTION]",
                    help="--ft: a failure at a chosen point of a round instead of a clock (repeatable; POINT inner, "
                    "head, lanes or commit; ACTION kill (default; restarted --restart-after seconds later) or "
                    "error: docs/fault_tolerance.md)")
    ft.add_argument("--restart-after", type=float, default=5.0, metavar="SECONDS",
                    help="--ft: restart a killed replica after SECONDS (default: %(default)s)")
    ft.add_argument("--warm-spare", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="--ft: keep N started spares (a group of --nproc-per-replica ranks) per replica, set up before "
                    "the run (N=1 when not given); one takes a lost replica's place at once, instead of a restart "
                    "--restart-after seconds later; one more starts when the last is used (lioncub.ft.spare)")
    ft.add_argument("--ft-standby", action="store_true",
                    help="--ft-replica: start as a warm spare, waiting on standard input to be activated")
    ft.add_argument("--ft-stop-round", type=int, default=None, metavar="R",
                    help="--ft: stop at the first commit from round R on with every replica in its quorum (a run "
                    "that ends on events, not the clock; --budget stays the limit)")
    ft.add_argument("--heartbeat-ms", type=int, default=1000,
                    help="--ft: the lighthouse's heartbeat timeout, after which a silent replica leaves the quorum")
    ft.add_argument("--ft-replica", type=int, default=None, metavar="K",
                    help="run as replica K of a fault-tolerant job (one per machine on a real cluster; needs "
                    "--lighthouse or TORCHFT_LIGHTHOUSE)")
    ft.add_argument("--lighthouse", default=None, help="--ft-replica: the lighthouse's address (http://HOST:PORT)")
    ft.add_argument("--ft-host", default="127.0.0.1", help="--ft-replica: the address peers reach this replica at")
    ft.add_argument("--ft-rank", type=int, default=0, help=argparse.SUPPRESS)  # this rank of its replica group
    ft.add_argument("--ft-group-port", type=int, default=0, help=argparse.SUPPRESS)  # the group's rendezvous
    ft.add_argument("--ft-ready-dir", default=None, help=argparse.SUPPRESS)  # a fresh start's barrier (lioncub.ft.train)
    ft.add_argument("--ft-deadline", type=float, default=None, help=argparse.SUPPRESS)
    ft.add_argument("--ft-config", default=None, help=argparse.SUPPRESS)
    ft.add_argument("--ft-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="--ft/--ft-replica: a collective's time limit (default: %(default)s)")


def cmd_train_ft(args) -> int:
    """``--ft`` (the supervisor) and ``--ft-replica K`` (one replica): see :mod:`lioncub.ft.train`."""
    import json

    try:
        from . import require_torchft

        require_torchft()
    except ImportError as exc:
        args.parser.error(str(exc))
    if args.ft_config:  # the supervisor's resolved config
        with open(args.ft_config) as f:
            fields = json.load(f)
        fields["betas"] = tuple(fields["betas"])
    else:
        from ..harness.compare import LOCALCUB

        fields = {k: v for k, v in vars(args).items()
                  if k not in ("func", "parser", "compare", "command", "link", "argv", "budget") + _FT_KEYS}
        try:
            fields.update(aggregation_fields(fields.pop("aggregation"), args, local=args.local_steps != 1))
        except ValueError as exc:
            args.parser.error(str(exc))
        if args.optimizer is None and args.vote is None and args.aggregation is None:  # the comparison's LocalCub
            default = TrainConfig()
            fields.update({k: v for k, v in LOCALCUB.items() if fields[k] == getattr(default, k)})
        fields["optimizer"] = "lioncub"
        fields["vote"] = fields["vote"] or "pbit"
        fields["betas"] = tuple(fields["betas"])
        fields["steps"] = 10 ** 9
        fields["eval_every"] = 0
        fields["time_budget"] = args.budget if args.budget is not None else FT_DEFAULT_BUDGET_S
    try:
        config = TrainConfig(**fields)
        if config.local_steps == "auto":
            raise ValueError("--ft: --local-steps must be an int (1: LionCub's every-step vote, FTLionCub)")
        if config.pace != "slowest":
            raise ValueError(f"--ft: --pace {config.pace} needs every replica's steps in each round; torchft's quorum "
                             "decides who is in a round: leave --pace at slowest")
        if args.nproc_per_replica < 1:
            raise ValueError(f"--nproc-per-replica must be >= 1 (ranks per replica group), got {args.nproc_per_replica}")
        if args.inside != "fsdp2" and args.nproc_per_replica == 1:
            raise ValueError("--inside mean averages the gradients over a replica group's ranks: give "
                             "--nproc-per-replica N > 1 (with one rank a group is one worker)")
        from ..votes.rounds import PARTIAL_NEEDS, round_partial

        if not round_partial(config.vote, config.aggregate, config.quantizer):
            raise ValueError(f"--ft: a replica left out of a quorum must add nothing to its sums: {PARTIAL_NEEDS}")
    except ValueError as exc:
        args.parser.error(str(exc))
    from ..harness.train import check_inputs

    if args.ft_replica is not None:
        from .replica import replica_main

        lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            args.parser.error("--ft-replica needs --lighthouse ADDR or TORCHFT_LIGHTHOUSE")
        from . import QuorumError

        try:
            from .faults import parse_fault

            faults = [parse_fault(spec) for spec in args.ft_fault]
            return replica_main(config, args.ft_replica, args.replicas, lighthouse, host=args.ft_host,
                                deadline=args.ft_deadline, min_replicas=args.min_replicas, timeout_s=args.ft_timeout,
                                faults=faults, standby=args.ft_standby, stop_round=args.ft_stop_round,
                                rank=args.ft_rank, ranks=args.nproc_per_replica, group_port=args.ft_group_port,
                                ready_dir=args.ft_ready_dir, inside=args.inside)
        except (ConnectionError, QuorumError) as exc:  # what a user fixes: one line, not a traceback
            print(f"lioncub train --ft-replica {args.ft_replica}: {exc}", file=sys.stderr)
            return 1
    from .summary import format_summary
    from .train import FTPlan, run_ft

    link = None if args.link is None or args.link.lower() == "none" else args.link.lower()
    plan = FTPlan(replicas=args.replicas, min_replicas=args.min_replicas, kill_every=args.kill_every,
                  restart_after=args.restart_after, heartbeat_ms=args.heartbeat_ms, timeout_s=args.ft_timeout,
                  link=link, faults=tuple(args.ft_fault), warm_spare=args.warm_spare,
                  stop_round=args.ft_stop_round, nproc_per_replica=args.nproc_per_replica, inside=args.inside)
    try:
        plan.check()
        check_inputs(config, args.replicas * args.nproc_per_replica)
        if link is not None:
            from ..testbed import testbed_unavailable

            reason = testbed_unavailable()
            if reason is not None:
                raise ValueError(f"--link {args.link}: {reason}")
    except ValueError as exc:
        args.parser.error(str(exc))
    os.makedirs(config.out, exist_ok=True)
    path = os.path.join(config.out, "ft_config.json")
    with open(path, "w") as f:
        json.dump(config.as_dict(), f)
    try:
        run = run_ft(config, plan, ["--ft-config", path, "--out", config.out], budget=config.time_budget)
    except RuntimeError as exc:
        print(f"lioncub train --ft: {exc}", file=sys.stderr)
        return 1
    print(format_summary(run.summary, plan, config.local_steps))
    print(f"\nwrote {config.out}/ft_summary.json and {config.out}/replica_*.jsonl")
    return 0
