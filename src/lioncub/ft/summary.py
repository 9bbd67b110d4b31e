"""The summary of a fault-tolerant run (``lioncub train --ft``): from the replicas' logs and the supervisor's
record, the throughput, the stall per failure, the way back of a lost replica, the rounds lost or repeated and
the end state (:mod:`lioncub.ft.train`'s docstring says what each means)."""
from __future__ import annotations

import json
import os
import statistics
from typing import Optional

__all__ = ["read_logs", "summarize", "format_summary"]


def read_logs(out: str, replicas: int) -> list[list[dict]]:
    logs = []
    for k in range(replicas):
        path = os.path.join(out, f"replica_{k}.jsonl")
        with open(path) as f:
            logs.append([json.loads(line) for line in f if line.strip()])
    return logs


def summarize(out: str, plan, run, *, budget: float) -> dict:
    """Throughput, stalls per failure, rounds lost or repeated, the end state (see the module docstring);
    ``plan``: the run's :class:`~lioncub.ft.train.FTPlan`, ``run``: its :class:`~lioncub.ft.train.FTRun`."""
    logs = read_logs(out, plan.replicas)
    commits: dict[int, float] = {}  # round -> its earliest commit time on any replica
    lost_or_repeated, healed_over = 0, 0
    for log in logs:
        life: list[tuple[int, int]] = []  # (round, heals) of each commit of this life
        for rec in log + [dict(kind="start")]:
            if rec["kind"] == "start":  # a life's rounds must follow one another: none skipped, none twice
                for (a, heals_a), (b, heals_b) in zip(life, life[1:]):
                    if b > a + 1 and heals_b > heals_a:  # it did not commit a round its peers did, then healed
                        healed_over += b - a - 1
                    elif b != a + 1:
                        lost_or_repeated += 1
                life = []
            elif rec["kind"] == "round":
                life.append((rec["round"], rec.get("heals", 0)))
                commits[rec["round"]] = min(commits.get(rec["round"], rec["wall"]), rec["wall"])
    finals = [next((r for r in reversed(log) if r["kind"] == "final"), None) for log in logs]
    rounds = sorted(commits)
    walls = [commits[k] for k in rounds]
    gaps = [b - a for a, b in zip(walls, walls[1:])]
    typical = statistics.median(gaps) if gaps else 0.0
    records = sorted((r for log in logs for r in log if r["kind"] == "round"), key=lambda r: r["wall"])
    agree = statistics.median([r["stall"] for r in records]) if records else 0.0  # a round's end to its commit
    contributors = {r["round"]: r["contributors"] for r in records}

    def first_after(wall: float, skip: int) -> Optional[dict]:
        """The first commit after ``wall`` on a replica other than ``skip``."""
        return next((r for r in records if r["wall"] > wall and r["replica"] != skip), None)

    stalls = []
    for kill in run.kills:  # detection (the survivors' wait at the next round end) + the rejoin's commit
        lost = first_after(kill["wall"], kill["replica"])
        joined = [r for r in logs[kill["replica"]] if r["kind"] == "joined" and r["wall"] > kill["wall"]]
        back = first_after(joined[0]["wall"] - 1e-6, kill["replica"]) if joined else None
        if back is not None and lost is not None and back["round"] == lost["round"]:
            back = None  # the replica was back by the survivors' next commit: one wait, counted once
        stalls.append(None if lost is None else sum(max(0.0, r["stall"] - agree) for r in (lost, back) if r))
    rejoin = []
    for restart in run.restarts:  # from the restart to the commit at which the replica joined
        joined = [r for r in logs[restart["replica"]] if r["kind"] == "joined" and r["wall"] >= restart["wall"]]
        rejoin.append(joined[0]["wall"] - restart["wall"] if joined else None)
    back = []
    for kill in run.kills:  # from the kill to the commit at which the replica's next life joined
        joined = [r for r in logs[kill["replica"]] if r["kind"] == "joined" and r["wall"] > kill["wall"]]
        back.append(joined[0]["wall"] - kill["wall"] if joined else None)
    done = [f for f in finals if f is not None]
    span = walls[-1] - walls[0] if len(walls) > 1 else 0.0
    summary = dict(
        rounds=rounds[-1] if rounds else 0, span_s=span, rounds_per_s=(len(walls) - 1) / span if span else 0.0,
        # the replicas' inner steps that went into committed rounds, per second (a lost replica's are missing)
        replica_rounds_per_s=sum(contributors.get(k, 0) for k in rounds[1:]) / span if span else 0.0,
        round_s_median=typical, agree_s_median=agree, kills=len(run.kills), restarts=len(run.restarts),
        stall_s=stalls, stall_mean_s=statistics.mean([s for s in stalls if s is not None])
        if any(s is not None for s in stalls) else None,
        stall_max_s=max([s for s in stalls if s is not None], default=None),
        rejoin_s=rejoin, kill_to_join_s=back, uncommitted=max((r.get("uncommitted", 0) for log in logs for r in log), default=0),
        heals=sum(1 for log in logs for r in log if r["kind"] == "joined" and r.get("heals", 0)),
        lost_or_repeated_rounds=lost_or_repeated, healed_over_rounds=healed_over,
        # each shard across the groups (a group of many ranks: its final line holds every rank's hash, in rank order)
        finished=len(done), identical=len({tuple(f.get("digests", [f["digest"]])) for f in done}) == 1 if done else False,
        final_round=done[0]["round"] if done else None,
        val_loss=done[0].get("val_loss") if done else None, budget_s=budget)
    if any(f is not None and "straggler" in f for f in finals):  # --slow-worker/--pause-worker: each replica's
        summary["straggler"] = [None if f is None else f.get("straggler") for f in finals]  # last life's record
    return summary


def format_summary(summary: dict, plan, H: int) -> str:
    """The summary's lines for the terminal (``plan``: the run's :class:`~lioncub.ft.train.FTPlan`)."""
    s = summary
    what = "LionCub (the vote every step)" if H == 1 else "LocalCub"
    ranks = getattr(plan, "nproc_per_replica", 1)
    within = "FSDP2 inside" if plan.inside == "fsdp2" else "a node mean inside"
    groups = f"{plan.replicas} replica groups of {ranks} ranks ({within})" if ranks > 1 else f"{plan.replicas} replicas"
    lines = [f"fault-tolerant {what}: {groups}, kill every {plan.kill_every:g} s "
             f"(restart after {plan.restart_after:g} s), link {plan.link or 'loopback'}",
             f"  committed rounds {s['rounds']} in {s['span_s']:.1f} s: {s['rounds_per_s'] * H:.2f} steps/s "
             f"(H={H}; median round {s['round_s_median']:.2f} s, of which {s['agree_s_median']:.2f} s agreeing), "
             f"{s['replica_rounds_per_s'] * H:.2f} replica-steps/s",
             f"  kills {s['kills']}, restarts {s['restarts']}, uncommitted agreements {s['uncommitted']}, "
             f"lost or repeated rounds {s['lost_or_repeated_rounds']}, rounds taken from a peer by a heal after "
             f"an uncommitted agreement {s['healed_over_rounds']}"]
    if s["stall_mean_s"] is not None:
        lines.append(f"  stall per failure: mean {s['stall_mean_s']:.2f} s, max {s['stall_max_s']:.2f} s")
    back = [x for x in s.get("kill_to_join_s", []) if x is not None]
    rejoin = [x for x in s.get("rejoin_s", []) if x is not None]
    if back:
        lines.append(f"  a lost replica back in: kill to join mean {statistics.mean(back):.2f} s (restart to join mean "
                     f"{statistics.mean(rejoin):.2f} s){', warm spares' if plan.warm_spare else ''}")
    lines.append(f"  replicas finished {s['finished']}, identical at the end: {s['identical']}, "
                 f"val loss {s['val_loss'] if s['val_loss'] is None else round(s['val_loss'], 4)}")
    for k, w in enumerate(s.get("straggler", [])):
        if w is not None and (w["factor"] != 1 or w["pause_s"]):
            lines.append(f"  replica {k} slowed: compute {w['compute_s']:.1f} s, slept {w['slept_s']:.1f} s "
                         f"(x{w['factor']:g}), paused {w['paused_s']:.1f} s in {w['pauses']} pauses")
    return "\n".join(lines)
