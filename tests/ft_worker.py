"""One replica of the fault-tolerance tests (tests/test_ft.py), run as its own process.

``--mode ft``: one replica group of one worker under a torchft Manager (FTLocalCub);
``--mode plain``: rank ``--replica`` of a plain gloo group of ``--world`` (LocalCub), the
reference. Each trains a small MLP on its own seeded batches (replica r's batch at its inner
step t depends on (r, t) only), and appends a JSON line per committed round to ``--out``:
the round, the participants and contributors, and the parameters' float64 sum and a hash of
their bytes. ``--fault REPLICA:ROUND:POINT[:ACTION]`` (repeatable): a failure at a chosen point of a
round (lioncub.ft.faults; only this replica's apply). ``--nan-at REPLICA:K``: that replica's gradient
is NaN at its inner step K (once). ``--outer-state host``: LocalCub's outer state on the host (both modes).

A plain run resumed from a torchft replica's state (the survivors' reference after a failure):
``--save-at K:PATH`` (ft) saves the model and optimizer after the commit of round K (``{replica}`` in
PATH: the replica's index); ``--load PATH --from-ft`` (plain) resumes that state with LocalCub on the
plain group (θ_s, the outer, inner and error-feedback state as saved; only the envelope's kind, rank and
world are rewritten), or with ``--vote every-...`` with LionCub (the parameters, each inner Lion momentum as
LionCub's, the step count); ``--group 0,2`` (plain): the group is those replicas, each on its own batches.

A QuorumError ends the process with exit code 3 and its message on stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.flat, run as a script

def params_digest(model) -> tuple[str, float]:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16], float(flat.double().sum())


def batch(replica: int, t: int):
    g = torch.Generator().manual_seed(1000 * replica + t)
    x = torch.randn(16, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(16, 1, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ft", "plain"), required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--group", default="", help="plain: the replicas of the group, e.g. 0,2 (default: 0..world-1)")
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=0, help="stop after this many committed rounds (0: --steps)")
    ap.add_argument("--stop-file", default="", help="--rounds under torchft: ask to stop only once this file exists")
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--vote", default="grad")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--nan-at", default="-1:-1", help="REPLICA:STEP")
    ap.add_argument("--max-attempts", type=int, default=20)
    ap.add_argument("--save", default="", help="torch.save the optimizer state here after training")
    ap.add_argument("--load", default="", help="load the optimizer and model state from here first")
    ap.add_argument("--from-ft", action="store_true", help="plain: --load holds an FTLocalCub replica's state")
    ap.add_argument("--save-at", default="", help="ft: ROUND:PATH, the state saved after round ROUND's commit")
    ap.add_argument("--round-chunk", type=int, default=0, help="LocalCub.round_chunk (0: its default)")
    ap.add_argument("--scale-block", type=int, default=0, help="lioncub.optim.rounds.SCALE_BLOCK (0: its default)")
    ap.add_argument("--outer-state", default="device", help="LocalCub's outer_state: 'device' or 'host'")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from lioncub.ft import QuorumError  # (importable without torchft: only FTLocalCub needs it)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    kw = dict(lr=1e-2, local_steps=a.H, inner="adamw", outer="nesterov", outer_lr=0.7, outer_momentum=0.9,
              weight_decay=0.01, nonfinite="skip")
    every_step = a.vote.startswith("every-")  # LionCub's every-step vote: every-pbit, every-sign_allreduce
    if every_step:
        kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, vote=a.vote[len("every-"):])
        a.H = 1
    elif a.vote == "mean8":
        kw.update(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)
    else:
        kw.update(vote="grad")
    if not every_step:
        kw.update(outer_state=a.outer_state)
    if a.mode == "plain":
        import torch.distributed as dist
        group = [int(r) for r in a.group.split(",")] if a.group else list(range(a.world))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.master_port}",
                                rank=group.index(a.replica), world_size=len(group))
        from tests.flat import LionCub, LocalCub

        class EveryStep(LionCub):  # LionCub's counters under the names this loop reads
            rounds = property(lambda self: self.steps)
            skipped_rounds = property(lambda self: self.skipped_steps)
            local_step = 0

        opt = EveryStep(model.parameters(), **kw) if every_step else LocalCub(model.parameters(), **kw)
        manager = None
    else:
        from lioncub.ft import make_manager
        from tests.flat import FTLionCub, FTLocalCub
        manager = make_manager(str(a.replica), a.lighthouse, min_replicas=2, timeout_s=3.0, quorum_timeout_s=30.0)
        opt = (FTLionCub if every_step else FTLocalCub)(model.parameters(), manager, max_attempts=a.max_attempts, **kw)
        from lioncub.ft.faults import install, parse_fault
        install(opt, [parse_fault(spec) for spec in a.fault], a.replica)
    if a.round_chunk:
        opt.round_chunk = a.round_chunk
    if a.scale_block:
        from lioncub.optim import rounds
        rounds.SCALE_BLOCK = a.scale_block
    if a.load:
        saved = torch.load(a.load, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        if a.from_ft and every_step:  # FTLionCub's θ (the model) and inner Lion momenta are LionCub's state
            ft = saved["opt"]["local"]
            sd = opt.state_dict()
            sd["state"] = {i: {"exp_avg": s["exp_avg"]} for i, s in ft["inner"]["state"].items()}
            sd[opt.state_key]["counters"] = dict(steps=ft["counters"]["rounds"],
                                                 skipped_steps=ft["counters"]["skipped_rounds"])
            saved["opt"] = sd
        elif a.from_ft:  # one replica group's state, now rank r of the plain group's LocalCub
            saved["opt"].pop("ft")
            saved["opt"][opt.state_key].update(kind=type(opt).__name__, rank=opt.rank, world_size=opt.world_size)
        opt.load_state_dict(saved["opt"])

    log = open(a.out, "a")
    t0 = time.time()

    def log_round() -> None:
        digest, total = params_digest(model)
        rec = dict(replica=a.replica, round=opt.rounds, digest=digest, sum=total, t=time.time() - t0,
                   skipped=opt.skipped_rounds)
        if manager is not None:
            rec.update(participants=opt.participants, contributors=opt.contributors, uncommitted=opt.uncommitted,
                       heals=opt.heals, stall=opt.last_stall_s, wall=time.time())
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if a.save_at and opt.rounds == int(a.save_at.split(":", 1)[0]):
            path = a.save_at.split(":", 1)[1].replace("{replica}", str(a.replica))
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), path)

    if manager is not None:
        before = opt.rounds
        opt.join()  # the quorum (and a heal, for a replica that restarts) before the first inner step
        if opt.rounds != before:  # it healed, then took the round's outer step with the others
            log_round()
    start_step = opt.rounds * a.H + opt.local_step
    step = start_step
    while True:
        if a.rounds and manager is None and opt.rounds >= a.rounds:
            break
        if a.rounds and manager is not None:  # stop together, at the commit that carries the first request
            if opt.stop_agreed:
                break
            opt.stop_requested = opt.rounds >= a.rounds - 1 and (not a.stop_file or os.path.exists(a.stop_file))
        if not a.rounds and step >= a.steps:
            break
        x, y = batch(a.replica, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if [a.replica, step] == [int(x) for x in a.nan_at.split(":")] and opt.skipped_rounds == 0:
            model[0].weight.grad[0, 0] = float("nan")
        before, skipped = opt.rounds, opt.skipped_rounds
        try:
            opt.step()
        except QuorumError as exc:
            print(f"QuorumError: {exc}", file=sys.stderr, flush=True)
            log.close()
            os._exit(3)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        step = opt.rounds * a.H + opt.local_step
        if opt.rounds != before or opt.skipped_rounds != skipped:
            log_round()
    if a.save:
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), a.save)
    log.write(json.dumps(dict(replica=a.replica, done=True, round=opt.rounds, heals=getattr(opt, "heals", 0),
                              digest=params_digest(model)[0])) + "\n")
    exit_cleanly(log, manager)


def exit_cleanly(log, manager) -> None:
    """Close the log, shut the manager's servers down (without waiting) and end the process at once."""
    log.close()
    if manager is not None:
        manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
