"""The two-rank device-path check of ``make gpu-check`` (tests/gpu/gpu_check.py), and what the
checks share: the run's budget, the error helpers, the audit.

* ``device_paths_two_ranks`` — every path of :data:`lioncub.testing.paths.PATHS` (LionCub per
  vote, quantizers, overlap, auto, check_every, momentum sync, non-finite skip, state_dict
  resume, the DDP hook, LocalCub, NodeCub, the baselines) on two ranks with parameters on the
  GPU, each path under :class:`~lioncub.testing.audit.DeviceAudit`. With one GPU both ranks
  use ``cuda:0`` in a ``"cuda:gloo"`` group: gloo then serves CUDA tensors only and refuses
  CPU ones, as NCCL does (NCCL itself refuses two ranks on one GPU). With two or more GPUs:
  NCCL, rank r on ``cuda:r``. A path fails if it raises on a rank, the audit records a
  violation (a collective tensor off the GPU, a dtype or reduce op NCCL lacks, a library draw
  from the global RNG), a host sync happens inside backward, a step takes more host syncs than
  :data:`~lioncub.testing.paths.SYNC_BUDGET` allows, it issues no collective, or the two
  ranks' parameters afterwards differ (sha256 of every parameter's bytes, compared across the
  ranks; both ranks draw the same data, so every path must keep the replicas bit-identical).
  Process-group timeout 60 s; a rank that raises or dies gets the other killed at once (the
  launcher), the path is recorded as failed and the remaining paths run in a fresh group.

The budget (``_DEADLINE``, set by
gpu_check's ``main``) and the error helpers live here so that both modules share them.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

PG_TIMEOUT_S = 60  # process-group timeout of every group this script makes
_DEADLINE = [float("inf")]  # time.monotonic() at which the run's budget is spent (set by main)
_BUDGET = [270.0]  # the run's budget in seconds (set by main)
CAPS = {"kernels_vs_cpu_reference": 0.3, "device_paths_two_ranks": 0.35, "gloo_two_ranks_cuda": 0.2}
"""Each long check's share of the run's budget at most (together 0.85: the short checks and the bandwidth
rows, seconds each, fit in the rest); a check past its share is stopped and fails."""


def _left(cap: float = float("inf")) -> float:
    """Seconds left in the run's budget, at most ``cap``."""
    return min(cap, _DEADLINE[0] - time.monotonic())


def _err(exc: BaseException, n: int = 300) -> str:
    """``Type: first line`` of an exception."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:n] if lines else ''}"


def _tail(exc, lines: int = 12) -> str:
    """``Type:`` and the last lines of an exception's message (a WorkerError carries a traceback)."""
    if exc is None:
        return "no exception recorded"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: " + " | ".join(text[:1] + text[1:][-lines:])



@contextlib.contextmanager
def _ws1_group(device: str):
    """A world-size-1 group in this process: NCCL on CUDA, gloo in the dry run."""
    import torch.distributed as dist
    from lioncub.testbed.launch import free_port
    backend = "nccl" if device == "cuda" else "gloo"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one machine, maybe without a network
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _name(vote, bits, q) -> str:
    return vote + (f"-{bits}" if bits else "") + (f"-{q}" if q else "")


# ----------------------------------------------------------------------------- the device audit
@functools.lru_cache(maxsize=None)
def _audit_class():
    """:class:`~lioncub.testing.audit.DeviceAudit` with its "library frame" pinned to the
    lioncub package itself. The audit attributes a random draw or a sync to the innermost
    frame whose file name contains "lioncub" outside ``testing``; here the paths run under
    the launcher (``lioncub/testbed/launch.py``) and from a checkout whose directory may
    itself be called lioncub, which would make the paths' own data draws count as the
    library's. Everything else is the audit's own."""
    import lioncub
    from lioncub.testing.audit import DeviceAudit
    lib = os.path.realpath(os.path.dirname(lioncub.__file__)) + os.sep
    own = tuple(lib + d + os.sep for d in ("testing", "testbed"))

    @functools.lru_cache(maxsize=4096)
    def library(filename: str) -> bool:
        f = os.path.realpath(filename)
        return f.startswith(lib) and not f.startswith(own)

    class PathAudit(DeviceAudit):
        def _where(self) -> str:
            for frame in reversed(traceback.extract_stack()[:-3]):
                if library(frame.filename):
                    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
            return "?"

    return PathAudit


def _device(device: str):
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _inject_off_device(device, audit, steps: int = 1) -> None:
    """A collective on a tensor off the parameters' device: a CPU tensor on CUDA (NCCL and
    cuda:gloo refuse it), a meta tensor in the CPU dry run (the audit records it)."""
    import torch
    import torch.distributed as dist
    from lioncub.testing import paths
    paths._model(device)
    other = torch.device("meta") if device.type == "cpu" else torch.device("cpu")
    with audit.phase("step 0"):
        dist.all_reduce(torch.ones(4, device=other))


def _inject_rank1_raises(device, audit, steps: int = 1) -> None:
    """Rank 1 raises before a collective that rank 0 then waits in."""
    import torch
    import torch.distributed as dist
    from lioncub.testing import paths
    paths._model(device)
    if dist.get_rank() == 1:
        raise RuntimeError("injected: rank 1 fails before its collective")
    with audit.phase("step 0"):
        dist.all_reduce(torch.ones(4, device=device))


def _inject_replicas_differ(device, audit, steps: int = 1) -> None:
    """Rank 1 changes a parameter outside any optimizer: the replicas differ afterwards."""
    import torch
    import torch.distributed as dist
    from lioncub.testing import paths
    model = paths._model(device)
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    with audit.phase("step 0"):
        dist.all_reduce(torch.ones(4, device=device))


def _inject_hang(device, audit, steps: int = 1) -> None:
    """Both ranks stall where no collective notices (until the deadline or the time limit)."""
    from lioncub.testing import paths
    paths._model(device)
    with audit.phase("step 0"):
        time.sleep(3600)


INJECT = {"off-device": _inject_off_device, "rank1-raises": _inject_rank1_raises,
          "replicas-differ": _inject_replicas_differ, "hang": _inject_hang}
"""Deliberately broken paths (``--inject``), for the tests of this script: each must fail."""


def _path_table(inject=()) -> dict:
    from lioncub.testing.paths import PATHS
    table = dict(PATHS)
    table.update({f"inject {k}": INJECT[k] for k in inject})
    return table


def _rank_setup(mode: str, rank: int, world: int) -> str:
    """Per rank, before the rendezvous: one CPU thread; the GPU; the backend."""
    import torch
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if mode == "cpu":
        return "gloo"
    torch.cuda.set_device(0 if mode == "cuda:gloo" else rank)  # cuda:gloo: one GPU, both ranks on it
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one machine, maybe without a network
    return mode


@contextlib.contextmanager
def _recording_models(paths_module):
    """Every TinyLM a path builds (the baselines' subclass too), to checksum afterwards."""
    made = []
    cls = paths_module.TinyLM
    init = cls.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    cls.__init__ = record
    try:
        yield made
    finally:
        cls.__init__ = init


def _checksum(models) -> str:
    """sha256 of every parameter's bytes (names, dtypes and shapes included), in build order."""
    import torch
    h = hashlib.sha256()
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            data = p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            h.update(f"{i}.{name}:{p.dtype}:{tuple(p.shape)}|".encode())
            h.update(data.numpy().tobytes())
    return h.hexdigest()[:16]


def _log(fh, **row) -> None:
    fh.write(json.dumps(row) + "\n")
    fh.flush()


def _paths_worker(rank: int, world: int, names: list, mode: str, log_dir: str, inject: tuple) -> None:
    """Rank ``rank``: every path of ``names`` in order, each under the audit; one JSON line per
    event into ``log_dir/rank{rank}.jsonl`` (start, then done or error). A path that raises
    ends this rank (the launcher then kills the other: it may wait in a collective)."""
    import warnings

    import torch
    from lioncub.testing import paths
    warnings.filterwarnings("ignore")
    device = torch.device("cpu") if mode == "cpu" else torch.device("cuda", torch.cuda.current_device())
    table, Audit = _path_table(inject), _audit_class()
    with open(Path(log_dir) / f"rank{rank}.jsonl", "a") as fh:
        for name in names:
            _log(fh, path=name, rank=rank, event="start")
            audit = Audit(device)
            t0 = time.perf_counter()
            with _recording_models(paths) as models:
                try:
                    with audit:
                        table[name](device, audit)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except BaseException as exc:
                    _log(fh, path=name, rank=rank, event="error", error=_err(exc), t=time.time(),
                         where=traceback.format_exc().strip().splitlines()[-10:], violation_lines=audit.violations[:5])
                    raise
            steps = {k: n for k, n in audit.syncs_per_phase().items() if k.startswith("step")}
            worst = max(steps, key=steps.get) if steps else None
            _log(fh, path=name, rank=rank, event="done", seconds=round(time.perf_counter() - t0, 2),
                 **audit.summary(), violation_lines=audit.violations[:8], worst_step=worst,
                 worst_step_syncs=[f"{s.name} at {s.where}" for s in audit.syncs if s.phase == worst][:8],
                 backward_syncs=[f"{s.phase}: {s.name} at {s.where}" for s in audit.syncs_in_backward()][:8],
                 models=len(models), checksum=_checksum(models))


def _judge(rows: list, budget: int) -> list:
    """What is wrong with one path, from both ranks' rows (empty: it passed)."""
    problems = []
    for row in rows:
        r = f"rank {row['rank']}"
        if row["violations"]:
            problems.append(f"{r}: {row['violations']} violation(s): {row['violation_lines']}")
        if row["syncs_in_backward"]:
            problems.append(f"{r}: {row['syncs_in_backward']} host sync(s) inside backward: {row['backward_syncs']}")
        if row["max_syncs_per_step"] > budget:
            problems.append(f"{r}: {row['max_syncs_per_step']} host syncs in {row['worst_step']} (budget {budget}): "
                            f"{row['worst_step_syncs']}")
        if not row["collectives"]:
            problems.append(f"{r}: the audit saw no collective")
        if not row["models"]:
            problems.append(f"{r}: no model found to compare the replicas of")
    if len({row["checksum"] for row in rows}) > 1:
        problems.append("the replicas differ after the path: parameter checksums "
                        + ", ".join(f"rank {row['rank']} {row['checksum']}" for row in rows))
    return problems


def _read_logs(log_dir: str, world: int) -> dict:
    """{(path, rank): {event: row}} from the ranks' logs."""
    events = {}
    for r in range(world):
        f = Path(log_dir) / f"rank{r}.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                events.setdefault((row["path"], r), {})[row["event"]] = row
    return events


def _paths_mode(device: str):
    """(mode, world size, what it is): the dry run's gloo on CPU, cuda:gloo on one GPU, NCCL on two."""
    import torch
    if device == "cpu":
        return "cpu", 2, "2 ranks, gloo, CPU tensors (dry run)"
    if torch.cuda.device_count() >= 2:
        return "nccl", 2, "2 ranks, NCCL, rank r on cuda:r"
    return "cuda:gloo", 2, "2 ranks on cuda:0, backend 'cuda:gloo' (gloo serving CUDA tensors only)"


def check_device_paths_two_ranks(device: str, only=(), inject=()) -> dict:
    from lioncub.testbed.launch import WorkerError, spawn
    from lioncub.testing.paths import SYNC_BUDGET
    mode, world, what = _paths_mode(device)
    table = _path_table(inject)
    names = [n for n in table if _selected(n, only)] + [n for n in table if n.startswith("inject ")
                                                          and not _selected(n, only)]
    if not names:
        return dict(ok=False, error=f"no path matches --only {list(only)}")
    results, pending, groups = {}, list(names), 0
    end = time.monotonic() + _left(CAPS["device_paths_two_ranks"] * _BUDGET[0])
    while pending:
        left = end - time.monotonic()
        if left < 15:  # a group takes seconds to start: what is left is not run, and fails
            for name in pending:
                results[name] = dict(ok=False, problems=[f"not run: the check's time was spent ({left:.0f} s left)"])
            break
        groups += 1
        failure = None
        with tempfile.TemporaryDirectory(prefix="gpu-check-paths-") as log_dir:
            try:
                spawn(_paths_worker, world, pending, mode, log_dir, tuple(inject), timeout_s=PG_TIMEOUT_S,
                      deadline_s=left, setup=functools.partial(_rank_setup, mode))
            except (WorkerError, TimeoutError) as exc:
                failure = exc
            events = _read_logs(log_dir, world)
        done_upto = 0
        for name in pending:
            per = [events.get((name, r), {}) for r in range(world)]
            if not all("done" in e for e in per):
                break
            rows = [e["done"] for e in per]
            problems = _judge(rows, SYNC_BUDGET.get(name, 1))
            results[name] = dict(ok=not problems, problems=problems, ranks=rows)
            done_upto += 1
            _print_path(name, results[name], SYNC_BUDGET.get(name, 1))
        if done_upto == len(pending):
            if failure is not None:  # every path done, then the group failed (e.g. in its teardown)
                results["(group teardown)"] = dict(ok=False, problems=[_tail(failure)])
            break
        if not any("start" in e for e in events.values()):  # the group itself failed (start-up, rendezvous)
            for name in pending:
                results[name] = dict(ok=False, problems=["not run: the group of ranks failed before its first path: "
                                                         + _tail(failure)])
            print(f"    FAIL the group of ranks failed before its first path: {_tail(failure)}", flush=True)
            break
        name = pending[done_upto]  # the first path not done on every rank: it failed
        per = [events.get((name, r), {}) for r in range(world)]
        reported = sorted((e["error"] for e in per if "error" in e), key=lambda row: row["t"])  # first failure first:
        errors = [dict(rank=row["rank"], error=row["error"], where=row["where"],  # the others often fail in its wake
                       violation_lines=row["violation_lines"]) for row in reported]
        if not errors:  # no rank reported an exception: one crashed, was killed, or the group timed out
            errors = [dict(error=_tail(failure) if failure is not None else "no record of the path's end")]
        results[name] = dict(ok=False, problems=[f"rank {e['rank']}: {e['error']}" if "rank" in e else e["error"]
                                                 for e in errors],
                             errors=errors, started_on_ranks=[r for r, e in enumerate(per) if "start" in e])
        _print_path(name, results[name], SYNC_BUDGET.get(name, 1))
        pending = pending[done_upto + 1:]
    passed = [n for n in names if results.get(n, {}).get("ok")]
    failed = [n for n in results if not results[n]["ok"]]
    return dict(ok=not failed and len(passed) == len(names), mode=mode, world_size=world, ranks=what,
                paths_run=len(names), passed=passed, failed=failed, groups_started=groups, paths=results)


def _selected(name: str, only) -> bool:
    """``--only`` values: exact path names, or prefixes ending in ``*``; none: every path."""
    if not only:
        return not name.startswith("inject ")
    return any(name == o or (o.endswith("*") and name.startswith(o[:-1])) for o in only)


def _print_path(name: str, res: dict, budget: int) -> None:
    if res["ok"]:
        rows = res["ranks"]
        print(f"    ok   {name:40s} collectives {rows[0]['collectives']:3d}  syncs/step "
              f"{max(r['max_syncs_per_step'] for r in rows)} (budget {budget})  {rows[0]['seconds']} s", flush=True)
    else:
        print(f"    FAIL {name:40s} {'; '.join(res['problems'])[:1500]}", flush=True)


# ----------------------------------------------------------------------------- gloo, CUDA tensors, values
