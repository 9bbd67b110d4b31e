"""``lioncub train --ft``: LocalCub replica groups on torchft, with failures on a schedule.

Two roles, both reached from the CLI:

* a **replica** (:mod:`lioncub.ft.replica`; ``lioncub train --ft-replica K --replicas N --lighthouse ADDR ...``): one worker,
  its own world of one (the harness's data, model and evaluation), :class:`FTLocalCub` across the
  replicas through the lighthouse. It logs one JSON line per committed round to
  ``OUT/replica_K.jsonl`` (appending across restarts) and, after the replicas agreed to stop,
  a final line with the validation loss and a hash of the parameters.
* the **supervisor** (``lioncub train --ft``, :func:`run_ft`): starts a lighthouse (or uses
  ``TORCHFT_LIGHTHOUSE``), starts N replicas on loopback or each in its own network namespace
  behind a shaped link (``--link``), kills one with SIGKILL every ``--kill-every`` seconds
  (round-robin over the replicas, from the last) and restarts it ``--restart-after`` seconds
  later, then reads the logs into a summary (``OUT/ft_summary.json``): rounds and steps per
  second, the stall each failure cost, uncommitted rounds, heals, lost or repeated rounds (and the
  rounds a live replica took from a peer by a heal, after its own agreement did not commit), the
  final loss and whether the replicas ended identical.

With ``--nproc-per-replica N`` a replica is a group of N rank processes (``--ft-rank``), its own torch.distributed
world with the model FSDP2-sharded over it (:func:`shard_model`); rank 0 writes the group's log, and a kill or
a fault strikes the group's last rank, after which the supervisor kills the rest of the group and restarts it
whole (its ranks heal each its own shard from a live group).

The replicas stop together: each asks to stop once the run's deadline passed
(``FTLocalCub.stop_requested``), or, with ``--ft-stop-round R``, at a commit of round R or later whose quorum
holds every replica (an end set by events, not the clock: what the failure tests use), and all stop at the
commit that carries the first request.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional


from .summary import summarize

LIGHTHOUSE_PORT = 29510
JOIN_TIMEOUT_MS = 10_000
"""The first quorum waits this long for every replica to start (later ones form at once)."""
GROUP_PORT = 29520
"""With ``--link``, a replica group's rendezvous port (plus its life, mod 64) on its namespace's address."""
STARTUP_S = 30.0
"""Seconds granted to the replicas' start (imports, data) before the run's clock starts."""


@dataclass
class FTPlan:
    """What the supervisor runs (``lioncub train --ft``'s options)."""

    replicas: int = 3
    min_replicas: int = 2
    kill_every: float = 0.0  # seconds between kills (0: no failures)
    restart_after: float = 5.0
    heartbeat_ms: int = 1000
    timeout_s: float = 10.0  # a collective's limit: the longest a death inside one stalls the others
    warm_spare: int = 0  # spares per replica, started before the run and activated at once when it is lost
    rejoin_margin_s: float = 15.0  # no kill later than this (plus restart_after) before the deadline
    link: Optional[str] = None  # a rate (testbed, root), or None: loopback
    faults: tuple = ()  # lioncub.ft.faults specs, REPLICA:ROUND:POINT[:ACTION], each armed in its replica's first life
    stop_round: Optional[int] = None  # stop at a commit of this round or later with every replica in it
    nproc_per_replica: int = 1  # ranks per replica group (its own world, the model FSDP2-sharded over them)
    inside: str = "fsdp2"  # what a group of many ranks runs inside: FSDP2 shards, or 'mean' (a node mean)

    def check(self) -> "FTPlan":
        if self.replicas < 2:
            raise ValueError(f"--replicas must be >= 2 for fault tolerance, got {self.replicas}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"--min-replicas must be in 1..{self.replicas}, got {self.min_replicas}")
        if self.kill_every < 0 or self.restart_after < 0:
            raise ValueError("--kill-every and --restart-after must be >= 0 seconds")
        if self.kill_every and self.replicas - 1 < self.min_replicas:
            raise ValueError(f"--kill-every needs --replicas > --min-replicas (a kill leaves {self.replicas - 1} "
                             f"of the {self.min_replicas} a round needs)")
        from .faults import parse_fault

        for spec in self.faults:
            fault = parse_fault(spec)
            if fault.replica >= self.replicas:
                raise ValueError(f"--ft-fault {spec}: replica must be < --replicas ({self.replicas})")
        if self.stop_round is not None and self.stop_round < 1:
            raise ValueError(f"--ft-stop-round must be a round >= 1, got {self.stop_round}")
        if not 0 <= self.warm_spare <= 8:
            raise ValueError(f"--warm-spare must be 0..8 spares per replica, got {self.warm_spare}")
        if self.nproc_per_replica < 1:
            raise ValueError(f"--nproc-per-replica must be >= 1 (ranks per replica group), got {self.nproc_per_replica}")
        if self.inside not in ("fsdp2", "mean"):
            raise ValueError(f"--inside must be 'fsdp2' or 'mean' (what a replica group runs inside), got {self.inside!r}")
        if self.faults and self.kill_every:
            raise ValueError("--ft-fault and --kill-every are two schedules of failures: give one")
        return self


# ---------------------------------------------------------------------- the supervisor
@dataclass
class _Replica:
    index: int
    argv: list
    env: dict
    proc: Optional[subprocess.Popen] = None
    lives: int = 0
    down_since: Optional[float] = None
    spares: list = field(default_factory=list)  # its warm spares (lioncub.ft.spare), each a list of its ranks, first used first
    kill_planned: bool = False  # a kill fault is armed in this life: its SIGKILL is a scheduled kill
    ranks: int = 1  # ranks in its replica group (``proc`` is rank 0)
    others: list = field(default_factory=list)  # the group's ranks 1.. of this life
    own_host: bool = False  # its group alone on its host (a namespace): a fixed rendezvous port, not a free one
    spares_started: int = 0  # spare groups started so far (a spare group's rendezvous port follows it)

    @property
    def procs(self) -> list:
        """Every rank of this life of the group, rank 0 first."""
        return [] if self.proc is None else [self.proc, *self.others]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)


@dataclass
class FTRun:
    """The supervisor's record of a run: kills and restarts (wall times), the summary."""

    kills: list = field(default_factory=list)
    restarts: list = field(default_factory=list)
    late: list = field(default_factory=list)  # replicas restarted too late to rejoin, stopped unjoined
    summary: dict = field(default_factory=dict)


def lighthouse_main(argv: list[str]) -> int:
    """``python -m lioncub.ft.train lighthouse BIND MIN_REPLICAS HEARTBEAT_MS``: serve until killed."""
    from . import start_lighthouse

    host, port = argv[0].rsplit(":", 1)
    lh = start_lighthouse(int(argv[1]), host=host, port=int(port), heartbeat_timeout_ms=int(argv[2]),
                          join_timeout_ms=JOIN_TIMEOUT_MS)
    print(lh.address(), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    lh.shutdown()
    return 0


def run_ft(config, plan: FTPlan, replica_argv: list[str], *, budget: float) -> FTRun:
    """Run ``plan.replicas`` replicas of ``lioncub train`` (``replica_argv``: its options) for
    ``budget`` seconds of training, killing and restarting on the plan's schedule; the run's
    record, its summary also written to ``config.out/ft_summary.json``."""
    from . import require_torchft

    require_torchft()
    plan.check()
    os.makedirs(config.out, exist_ok=True)
    for k in range(plan.replicas):  # a fresh run: the replicas append to these
        path = os.path.join(config.out, f"replica_{k}.jsonl")
        if os.path.exists(path):
            os.remove(path)
    testbed = None
    if plan.link is not None:
        from ..testbed import Testbed

        testbed = Testbed(plan.replicas, rate=None if plan.link == "unshaped" else plan.link, prefix="lcft").__enter__()
    run = FTRun()
    lighthouse_proc = None
    try:
        hosts = testbed.ips if testbed is not None else ["127.0.0.1"] * plan.replicas
        address = os.environ.get("TORCHFT_LIGHTHOUSE") if testbed is None else None
        if not address:
            bind = f"{hosts[0]}:{_free_port() if testbed is None else LIGHTHOUSE_PORT}"
            cmd = [sys.executable, "-m", "lioncub.ft.train", "lighthouse", bind, str(plan.min_replicas),
                   str(plan.heartbeat_ms)]
            if testbed is not None:
                cmd = ["ip", "netns", "exec", testbed.namespaces[0]] + cmd
            lighthouse_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                               env=dict(os.environ, RUST_LOG="error"))
            lighthouse_proc.stdout.readline()
            address = f"http://{bind}"
        replicas = []
        for k in range(plan.replicas):
            argv = [sys.executable, "-m", "lioncub.cli", "train", *replica_argv, "--ft-replica", str(k),
                    "--replicas", str(plan.replicas), "--min-replicas", str(plan.min_replicas),
                    "--lighthouse", address, "--ft-host", hosts[k], "--ft-timeout", str(plan.timeout_s)]
            if plan.stop_round is not None:
                argv += ["--ft-stop-round", str(plan.stop_round)]
            if plan.nproc_per_replica > 1:
                argv += ["--nproc-per-replica", str(plan.nproc_per_replica), "--inside", plan.inside]
            env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
            env.pop("TORCHFT_LIGHTHOUSE", None)
            if testbed is not None:
                env["GLOO_SOCKET_IFNAME"] = testbed.ifnames[k]
                argv = ["ip", "netns", "exec", testbed.namespaces[k]] + argv
            replicas.append(_Replica(k, argv, env, ranks=plan.nproc_per_replica, own_host=testbed is not None))
        from .faults import parse_fault

        faults = [(spec, parse_fault(spec)) for spec in plan.faults]
        if plan.warm_spare:  # every spare set up before the replicas start: none takes their CPU once the clock runs
            _start_spares(replicas, plan.warm_spare)
        ready = os.path.join(config.out, "ready")  # the first lives' barrier before their first quorum
        shutil.rmtree(ready, ignore_errors=True)
        os.makedirs(ready)
        for r in replicas:  # each replica's faults, armed in its first life only
            mine = [(spec, f) for spec, f in faults if f.replica == r.index]
            _start(r, [arg for spec, _ in mine for arg in ("--ft-fault", spec)] + ["--ft-ready-dir", ready])
            r.kill_planned = any(f.action == "kill" for _, f in mine)
        try:
            _supervise(config, plan, replicas, run, budget)
        finally:
            for r in replicas:
                for spare in r.spares:
                    for proc in spare:
                        _kill(proc)
    finally:
        if lighthouse_proc is not None:
            _kill(lighthouse_proc)
        if testbed is not None:
            testbed.close()
    run.summary = summarize(config.out, plan, run, budget=budget)
    with open(os.path.join(config.out, "ft_summary.json"), "w") as f:
        json.dump(dict(plan=asdict(plan), kills=run.kills, restarts=run.restarts, late=run.late, summary=run.summary),
                  f, indent=1)
    return run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(r: _Replica, extra: tuple = ()) -> None:
    """Start the next life of ``r``: its one worker, or every rank of its group (a rendezvous port of this life's)."""
    group = []
    if r.ranks > 1:
        port = GROUP_PORT + r.lives % 64 if r.own_host else _free_port()
        group = ["--ft-group-port", str(port)]
    procs = [subprocess.Popen(list(r.argv) + list(extra) + group + (["--ft-rank", str(k)] if k else []), env=r.env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(r.ranks)]
    r.proc, r.others = procs[0], procs[1:]
    r.lives += 1
    r.down_since = None
    r.kill_planned = False


def _new_spare(r: _Replica, low: bool = False) -> list:
    """Start one warm spare of ``r`` (:func:`lioncub.ft.spare.start_spare`): its group's processes, with a rendezvous
    port of its own (with ``--link``, after the 64 that the group's lives take). ``low``: a spare started while the run
    goes on, at niceness 19 where its priority can be restored on activation (root), so its set-up takes only idle CPU."""
    from .spare import start_spare

    port = 0
    if r.ranks > 1:
        port = GROUP_PORT + 64 + r.spares_started % 64 if r.own_host else _free_port()
    r.spares_started += 1
    return start_spare(r.argv, r.env, r.ranks, port, nice=19 if low and os.geteuid() == 0 else 0)


def _start_spares(replicas: list, count: int) -> None:
    """Start ``count`` warm spares for every replica and wait until each of their processes is set up
    (:func:`lioncub.ft.spare.wait_ready`)."""
    from .spare import wait_ready

    for r in replicas:
        r.spares += [_new_spare(r) for _ in range(count)]
    for r in replicas:
        for proc in (p for spare in r.spares for p in spare):
            if not wait_ready(proc, STARTUP_S * len(replicas) * count * r.ranks):
                try:
                    proc.wait(timeout=5)
                    err = proc.stderr.read()[-3000:]
                except subprocess.TimeoutExpired:
                    err = "not ready in time"
                raise RuntimeError(f"a warm spare of replica {r.index} did not start:\n{err}")


def _replace(r: _Replica, deadline: Optional[float]) -> bool:
    """Activate ``r``'s first waiting warm spare, every process of its group, as its next life
    (:func:`lioncub.ft.spare.activate`); False when none is running whole (a spare group with a rank gone is killed)."""
    from .spare import activate, restore_priority

    while r.spares:
        spare = r.spares.pop(0)
        for p in spare:  # (a no-op for a spare started at the supervisor's priority)
            restore_priority(p)
        if all(p.poll() is None for p in spare) and all([activate(p, deadline) for p in spare]):
            r.proc, r.others, r.lives, r.down_since, r.kill_planned = spare[0], spare[1:], r.lives + 1, None, False
            return True
        for proc in spare:
            _kill(proc)
    return False


def _kill_group(r: _Replica) -> None:
    """SIGKILL every rank of ``r``'s group, its last rank first (the rest go with it: a group whose rank 0 lived on
    would keep its Manager's heartbeat, and the others would wait for a quorum with it)."""
    for proc in reversed(r.procs):
        if proc.poll() is None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _lines(out: str, index: int) -> list[dict]:
    path = os.path.join(out, f"replica_{index}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _stopped(out: str, replicas: list) -> bool:
    """Whether some replica finished (the agreed stop happened)."""
    return any(rec["kind"] == "final" for r in replicas for rec in _lines(out, r.index)[-1:])


def _joined_since(out: str, r: _Replica) -> bool:
    """Whether replica ``r``'s current life has joined the others."""
    kinds = [rec["kind"] for rec in _lines(out, r.index) if rec.get("pid") == r.proc.pid]
    return "joined" in kinds


def _first_commit(out: str) -> Optional[float]:
    path = os.path.join(out, "replica_0.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "joined":
                return rec["wall"]
    return None


def _supervise(config, plan: FTPlan, replicas: list, run: FTRun, budget: float) -> None:
    """Kill and restart on the schedule until every replica has exited (the agreed stop). The
    run's clock starts at the first commit (the replicas' join); a restarted replica is told the
    run's deadline."""
    next_kill, victim, deadline = None, plan.replicas - 1, None
    hard_stop = time.time() + STARTUP_S * 4 + budget + 120 + plan.timeout_s * 4
    while True:
        now = time.time()
        alive = [r for r in replicas if r.running()]
        if not alive and all(r.down_since is None for r in replicas):
            break
        if _stopped(config.out, replicas):  # the run is over: a replica still starting has nothing to join
            for r in alive:
                if not _joined_since(config.out, r):
                    _kill_group(r)
                    run.late.append(r.index)
            for r in replicas:
                r.down_since = None
        for r in replicas:  # one poll a rank: a fault's kill between two polls would read as a failure
            codes = [p.poll() for p in r.procs]
            failed = [k for k, code in enumerate(codes) if code not in (None, 0)]
            if r.kill_planned and -signal.SIGKILL in codes and r.down_since is None:
                # killed by its armed fault: a scheduled kill, restarted on schedule (its whole group)
                _kill_group(r)
                r.down_since, r.kill_planned = time.time(), False
                run.kills.append(dict(replica=r.index, wall=r.down_since))
            elif failed and r.down_since is None:  # failed on its own: an error of the run
                err = r.procs[failed[0]].stderr.read()[-3000:]
                for other in replicas:
                    _kill_group(other)
                rank = f" rank {failed[0]}" if r.ranks > 1 else ""
                raise RuntimeError(f"replica {r.index}{rank} exited with {codes[failed[0]]}:\n{err}")
        if deadline is None:
            first = _first_commit(config.out)
            if first is not None:
                deadline = first + budget
                next_kill = first + plan.kill_every if plan.kill_every else None
        if next_kill is not None and now >= next_kill and now < deadline - plan.restart_after - plan.rejoin_margin_s:
            r = replicas[victim]
            if r.running():
                _kill_group(r)
                r.down_since = time.time()
                run.kills.append(dict(replica=r.index, wall=r.down_since))
            victim = (victim - 1) % plan.replicas
            next_kill += plan.kill_every
        for r in replicas:
            if r.down_since is not None and _replace(r, deadline):  # a warm spare, at once
                run.restarts.append(dict(replica=r.index, wall=time.time(), spare=True))
            elif r.down_since is not None and now >= r.down_since + plan.restart_after:
                _start(r, ["--ft-deadline", f"{deadline:.3f}"])
                run.restarts.append(dict(replica=r.index, wall=time.time()))
            elif plan.warm_spare and not r.spares and r.proc is not None and _joined_since(config.out, r):
                r.spares.append(_new_spare(r, low=True))  # a spare again once this life has joined
        if now > hard_stop:
            for r in alive:
                _kill_group(r)
            raise RuntimeError("the replicas did not stop within 2 minutes of the deadline")
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lighthouse"]:
        sys.exit(lighthouse_main(sys.argv[2:]))
    sys.exit("usage: python -m lioncub.ft.train lighthouse HOST:PORT MIN_REPLICAS HEARTBEAT_MS")
