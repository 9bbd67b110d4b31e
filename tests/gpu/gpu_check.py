#!/usr/bin/env python3
"""One-shot GPU check of Lion Cub's CUDA path: ``make gpu-check OUT=dir`` (or tests/gpu/gpu_check.sh).

Writes ``DIR/gpu_check.json`` (rewritten after every check, so a run cut short still leaves
what it did) and prints one line per check. Installs nothing. The whole run has a time budget
(``--budget-s``, 270 s by default; tests/gpu/gpu_check.sh kills the process tree at 280 s): a check
that cannot start in what is left is recorded as failed ("not run"), never skipped. The checks,
in order:

* ``backend`` — CUDA tensors take the Triton kernels (else every comparison tests torch ops);
* ``step_clock`` — ``lioncub train``'s step clock (CUDA events, no device-wide sync) against a host clock;
* ``kernels_vs_cpu_reference`` — ``tests/test_triton*.py`` with ``LIONCUB_TEST_DEVICE=cuda``:
  every Triton kernel on CUDA copies of the inputs against the torch CPU path, bit for bit
  (odd sizes, every lane width, both tie parities, non-finite gradients);
* ``kernels_vs_torch_cuda`` — the kernels against torch's own CUDA ops on the same tensors.
  Exact when torch's CUDA ``add(alpha=)`` is one FMA as on CPU; allowed: 1 ulp on ``c``/``m``;
* ``lion_cuda_vs_cpu`` — :class:`lioncub.Lion` (torch ops) for 5 steps on CUDA and on CPU;
* ``lioncub_ws1_nccl`` — a world-size-1 NCCL group: LionCub on CUDA against Lion (one run: with one rank
  there is no vote, so this checks the NCCL group's set-up and the step around the vote, not a vote);
* ``nccl_ws1_calls`` — the library's collectives called directly in a world-size-1 NCCL group,
  under the device audit; ``device_paths_two_ranks`` — every path of
  :data:`lioncub.testing.paths.PATHS` on two ranks with GPU parameters (``cuda:gloo`` on one GPU,
  NCCL on two or more), each under the audit, the replicas compared (tests/gpu/gpu_check_ws1.py and
  tests/gpu/gpu_check_paths.py: their docstrings say what each asserts);
* ``gloo_two_ranks_cuda`` — 2 processes, one gloo group, CUDA tensors: every vote method
  (and pbit lane widths, L1 lanes, a NaN gradient skipped) against the same run on CPU
  tensors, and each collective LionCub uses asked of gloo on CUDA tensors
  (``gloo_cuda_collectives``). A refusal is a failure, here as everywhere;
* ``bandwidth`` — each kernel's GB/s (bytes read + written / time) on 64M elements next to
  a device-to-device copy moving the same bytes, and the torch path's time for the same pass;
  a kernel under a quarter of the copy's rate fails (tests/gpu/gpu_check_bandwidth.py).

What one GPU can and cannot prove: NCCL refuses two ranks on one device, so with one GPU the votes'
collectives run on two ranks through ``cuda:gloo`` (CUDA tensors, gloo's transport) and NCCL only at
world size 1 (its set-up and every collective call, ``nccl_ws1_calls``, but no reduction across ranks).
NCCL between ranks needs two GPUs (``device_paths_two_ranks`` then uses it).

Cross-implementation tolerance (stated once, ``_compare``): LionCub's votes on CUDA must equal
their CPU runs bit for bit (0 differing elements), except the L1-quantized vote, which takes its
scale from a torch reduction whose order differs between CPU and CUDA. That vote and the
comparisons of torch's own ops across devices (``lion_cuda_vs_cpu``, ``lioncub_ws1_nccl``) may
differ by at most 1 ulp per step in ``m`` and in at most 0.1% of ``p``'s elements (a sign of
``c`` flipped where ``c`` is within an ulp of 0).

Time: the budget's shares (``CAPS`` in tests/gpu/gpu_check_paths.py) cap the three long checks at
0.3, 0.35 and 0.2 of it; the rest takes seconds.

Exit codes: 0 every check ran and passed; 1 a check failed, was not run for lack of time, or
the run was interrupted (SIGTERM/SIGINT: the report says so); 3 CUDA is not available:
nothing was checked (the report says so). tests/gpu/gpu_check.sh adds 124/137: killed at its
time limit.

``--dry-run`` runs the same code on CPU to check this script without a GPU: device ``cpu``,
plain gloo (2 ranks for the two-rank checks, 1 for the world-size-1 ones), Triton's
interpreter (``TRITON_INTERPRET=1``) and tiny sizes. ``--checks`` and ``--only`` run a subset
(tests; the report records it). ``--inject`` adds deliberately broken paths to
``device_paths_two_ranks`` (tests of this script: each must be reported as failed).
``--compile-only`` compiles every kernel for a GPU architecture without one (Triton's
bundled ptxas).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(Path(__file__).resolve().parent)]  # lioncub without installing it

from gpu_check_paths import (CAPS, INJECT, PG_TIMEOUT_S, _BUDGET, _DEADLINE, _err, _left, _name,  # noqa: E402
                             _ws1_group, check_device_paths_two_ranks)
from gpu_check_ws1 import check_nccl_ws1_calls  # noqa: E402
from gpu_check_bandwidth import check_bandwidth  # noqa: E402

STEPS = 4  # optimizer steps per compared run (both tie parities)
VOTES = [("grad", None, None), ("sign_allreduce", None, None), ("gather", None, None), ("onebit", None, None),
         ("pbit", 2, None), ("pbit", 4, None), ("pbit", 8, None), ("pbit", 4, "l1"), ("pbit", 8, "l1")]
# ----------------------------------------------------------------------------- comparisons
def _ulps(a, b) -> int:
    """Largest distance in ulps between equal-shaped fp32 tensors (equal values: 0)."""
    import torch
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    d = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    d[a == b] = 0
    return int(d.max()) if d.numel() else 0


def _compare(got: list, want: list, steps: int, exact_only: bool = False) -> dict:
    """ps + ms of two runs (first half p, second half m): exact, or within the stated tolerance (none with
    ``exact_only``: a vote whose every operation is reproduced bit for bit across devices, see :func:`_exact`)."""
    import torch
    half = len(got) // 2
    exact = all(torch.equal(a.detach().cpu().view(torch.int32), b.detach().cpu().view(torch.int32))
                for a, b in zip(got, want))
    m_ulps = max([_ulps(a, b) for a, b in zip(got[half:], want[half:])] + [0])
    p_diff = sum(int((a.detach().cpu() != b.detach().cpu()).sum()) for a, b in zip(got[:half], want[:half]))
    p_total = sum(a.numel() for a in got[:half])
    frac = p_diff / max(p_total, 1)
    return dict(exact=exact, m_max_ulps=m_ulps, p_differ_fraction=frac, exact_required=exact_only,
                ok=exact or (not exact_only and m_ulps <= steps and frac <= 1e-3))


def _exact(vote: str, bits, quantizer) -> bool:
    """Whether LionCub's run of this vote on CUDA must equal its CPU run bit for bit: every vote but the L1
    quantizer's (its scale is a torch reduction, summed in another order on CUDA). The Triton kernels equal the
    C loops and torch ops bit for bit (tests/test_triton*.py), gloo reduces CUDA tensors on the host in the CPU
    order, and the votes' sums are integers."""
    return quantizer is None


def _grads(shapes, step: int, rank: int, nan: bool = False):
    """The gradients of one step on one rank (CPU, seeded): exact zeros every 5th element
    (ties of c at step 0), a NaN in the first tensor when asked."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for s in shapes:
        t = torch.randn(s, generator=g)
        t.view(-1)[::5] = 0.0
        out.append(t)
    if nan:
        out[0].view(-1)[3] = float("nan")
    return out


SHAPES = [(37, 29), (29,), (11, 29), (11,), (1001,)]  # odd sizes: bytes shared between tensors


def _run(make_opt, device: str, rank: int = 0, nan_step: int = -1, shapes=SHAPES, steps: int = STEPS):
    """``steps`` steps of an optimizer over fresh parameters on ``device``; returns ps + ms (CPU)."""
    import torch
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = make_opt(params)
    for step in range(steps):
        for p, g in zip(params, _grads(shapes, step, rank, nan=step == nan_step)):
            p.grad = g.to(device)
        opt.step()
    ms = [opt.state[p]["exp_avg"] for p in params]
    return [t.detach().cpu().clone() for t in params + ms]


# ----------------------------------------------------------------------------- checks
def check_backend(device: str) -> dict:
    """CUDA tensors must take the Triton kernels (else every comparison below would test torch ops)."""
    import torch
    from lioncub import fused
    from lioncub.fused import triton as triton_kernels
    x = torch.zeros(3, device=device)
    takes = fused.usable([x]) and fused._gpu(x) is not None
    return dict(ok=takes or device == "cpu", cuda_tensors_take_triton=takes, triton_kernels=triton_kernels.status(),
                fused_cpu=fused.status())


def check_kernels_vs_cpu_reference(device: str) -> dict:
    kept = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []  # the caller's, after ours
    env = dict(os.environ, LIONCUB_TEST_DEVICE=device, PYTHONPATH=os.pathsep.join(sys.path[:2] + kept))
    if device == "cpu":  # the dry run: every kernel of the test file (its probes too) interpreted
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled for the GPU
    limit = _left(CAPS["kernels_vs_cpu_reference"] * _BUDGET[0])
    if limit < 20:
        return dict(ok=False, error=f"not run: {limit:.0f} s left of the run's budget")
    try:  # the test file's own checks, run without pytest (a GPU machine need not have it)
        r = subprocess.run([sys.executable, os.path.join("tests", "gpu", "kernel_runner.py")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the runner
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return dict(ok=False, error=f"the kernel tests ran past {limit:.0f} s; killed",
                    output_tail=out.strip().splitlines()[-15:])
    try:
        report = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return dict(ok=False, returncode=r.returncode, output_tail=(r.stdout + r.stderr).strip().splitlines()[-15:])
    return dict(ok=r.returncode == 0, returncode=r.returncode, passed=len(report["passed"]), failed=report["failed"],
                skipped=report["skipped"], not_run=report["not_run"])


def check_kernels_vs_torch_cuda(device: str, big: int) -> dict:
    import torch
    from lioncub.fused import triton as tk
    from lioncub.lion import apply_update_, interpolate
    sizes = [big + 77, 1001]
    ms = [t.to(device) for t in _grads(sizes, 1, 0)]
    gs = [(t * 1e-2).to(device) for t in _grads(sizes, 2, 0)]
    out = {}
    for beta1, maximize in [(0.9, False), (0.95, True)]:
        c = torch.empty(sum(sizes), device=device)
        tk.interpolate(ms, gs, beta1, maximize, c)
        want = torch.cat([x.reshape(-1) for x in interpolate(ms, gs, beta1, maximize=maximize)])
        out[f"c_ulps_beta1_{beta1}"] = _ulps(c, want)
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=gen).to(device) for n in sizes]
    u = torch.randint(-1, 2, (sum(sizes),), generator=gen, dtype=torch.int8).to(device)
    p_ref, m_ref = [p.clone() for p in ps], [m.clone() for m in ms]
    apply_update_(p_ref, list(u.float().split(sizes)), m_ref, gs, lr=3e-4, beta2=0.99, weight_decay=0.1, foreach=True)
    tk.apply(ps, ms, gs, u, lr=3e-4, beta2=0.99, weight_decay=0.1)
    out["p_ulps"] = max(_ulps(a, b) for a, b in zip(ps, p_ref))
    out["m_ulps"] = max(_ulps(a, b) for a, b in zip(ms, m_ref))
    out["exact"] = all(v == 0 for k, v in out.items() if k != "exact")
    out["ok"] = out["p_ulps"] == 0 and all(v <= 1 for k, v in out.items() if k not in ("exact", "p_ulps"))
    return out


def check_lion_cuda_vs_cpu(device: str) -> dict:
    from lioncub import Lion
    make = lambda ps: Lion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=True)  # noqa: E731
    return _compare(_run(make, device, steps=5), _run(make, "cpu", steps=5), 5)


def check_lioncub_ws1(device: str) -> dict:
    """LionCub in a world-size-1 NCCL group against Lion on the same device. One run: with one rank there is
    nothing to vote (the majority of one is its own sign), so every vote setting takes the same step; the votes
    are exercised on two ranks (``device_paths_two_ranks``, ``gloo_two_ranks_cuda``)."""
    from lioncub import Lion
    from tests.flat import LionCub
    with _ws1_group(device) as backend:
        want = _run(lambda ps: Lion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), device)
        got = _run(lambda ps: LionCub(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), device)
        return dict(_compare(got, want, STEPS), backend=backend,
                    note="world size 1: LionCub's step without a vote (the votes run in the two-rank checks)")


def _collectives(device: str) -> dict:
    """Each collective LionCub uses, on ``device`` tensors in the current gloo group: a
    refusal (or a wrong result) fails the check."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    ones = lambda dtype=torch.uint8, n=10: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    calls = {
        "all_reduce uint8 SUM": lambda: (ones(), lambda t: dist.all_reduce(t)),
        "all_reduce int8 SUM": lambda: (ones(torch.int8), lambda t: dist.all_reduce(t)),
        "all_reduce float32 SUM": lambda: (ones(torch.float32), lambda t: dist.all_reduce(t)),
        "all_reduce float32 MAX": lambda: (ones(torch.float32), lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)),
        "all_reduce bfloat16 SUM": lambda: (ones(torch.bfloat16), lambda t: dist.all_reduce(t)),
        "all_gather_into_tensor uint8": lambda: (torch.empty(10 * world, dtype=torch.uint8, device=device),
                                                 lambda t: gather_flat(t, ones())),
        "all_to_all_single uint8": lambda: (torch.empty(4 * world, dtype=torch.uint8, device=device),
                                            lambda t: dist.all_to_all_single(t, ones(n=4 * world))),
        "broadcast float32": lambda: (ones(torch.float32), lambda t: dist.broadcast(t, src=0)),
    }
    want = {"all_reduce uint8 SUM": world, "all_reduce int8 SUM": world, "all_reduce float32 SUM": world,
            "all_reduce bfloat16 SUM": world}
    out = {}
    for name, make in calls.items():
        try:
            t, call = make()
            call(t)
            good = t.device.type == torch.device(device).type and bool((t.float() == want.get(name, 1)).all())
            out[name] = dict(ok=good, **({} if good else {"error": f"wrong result {t.float().tolist()[:4]}"}))
        except Exception as exc:  # noqa: BLE001 - recorded, and a failure
            out[name] = dict(ok=False, error=_err(exc, 200))
    return out


def _gloo_worker(rank: int, world: int, device: str) -> dict:
    from tests.flat import LionCub
    result = {"collectives": _collectives(device), "votes": {}}
    for vote, bits, q in VOTES:
        make = lambda ps: LionCub(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, vote=vote,  # noqa: E731
                                  bits=bits, quantizer=q, nonfinite="skip_step", bucket_mb=0.004,
                                  message_mb=0.001)  # several buckets and messages
        name = _name(vote, bits, q)
        want = _run(make, "cpu", rank, nan_step=2 if rank == 1 else -1)
        try:
            got = _run(make, device, rank, nan_step=2 if rank == 1 else -1)
        except Exception as exc:  # noqa: BLE001 - a refusal or a crash: a failure, with where
            result["votes"][name] = dict(ok=False, error=_err(exc),
                                         where=traceback.format_exc().strip().splitlines()[-6:])
            continue
        result["votes"][name] = _compare(got, want, STEPS, exact_only=_exact(vote, bits, q))
    return result


def check_gloo_two_ranks(device: str) -> dict:
    from lioncub.testbed.launch import spawn
    limit = _left(CAPS["gloo_two_ranks_cuda"] * _BUDGET[0])
    if limit < 20:
        return dict(ok=False, error=f"not run: {limit:.0f} s left of the run's budget")
    results = spawn(_gloo_worker, 2, device, timeout_s=PG_TIMEOUT_S, deadline_s=limit)
    votes = {name: {f"rank{r}": res["votes"][name] for r, res in enumerate(results)} for name in results[0]["votes"]}
    for name, per in votes.items():
        per["ok"] = all(v["ok"] for v in per.values())
    collectives = {name: {f"rank{r}": res["collectives"][name] for r, res in enumerate(results)}
                   for name in results[0]["collectives"]}
    for name, per in collectives.items():
        per["ok"] = all(v["ok"] for v in per.values())
    return dict(ok=all(v["ok"] for v in votes.values()) and all(v["ok"] for v in collectives.values()),
                votes=votes, collectives=collectives)


def check_step_clock(device: str) -> dict:
    """The harness's step clock (CUDA events) against a host clock around a synchronised matrix product: the
    events' seconds positive and not above the host's."""
    import torch
    from lioncub.harness.train import StepClock
    cuda = device == "cuda"
    timer = StepClock(cuda)
    a = torch.randn(2048 if cuda else 64, 2048 if cuda else 64, device=device)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    timer.mark("start")
    for _ in range(8):
        a = (a @ a).clamp_(-1, 1)
    timer.mark("end")
    seconds = timer.seconds("start", "end")
    host = time.perf_counter() - t0  # (seconds() waited for the stream up to "end")
    return dict(ok=0 < seconds <= host * 1.01 + 1e-4, events_s=seconds, host_s=host, cuda_events=cuda)


# ----------------------------------------------------------------------------- compile only
def compile_all(arch: int, quick: bool = False) -> list:
    """Compile the kernels for ``sm_<arch>`` without a GPU (every specialization; one per
    kernel with ``quick``). Returns (kernel, specialization, seconds, cubin bytes) rows."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lioncub.fused import triton as tk
    target = GPUTarget("cuda", arch, 32)
    P, I32, F, I64 = "*fp32", "i32", "fp32", "i64"
    jobs = []
    lanes = [(0, bits, even) for bits in (1, 2, 4, 8) for even in (True, False)]  # MODE 0: packed lanes
    for mode, bits, even in ([(0, 4, True)] if quick else lanes + [(1, 8, False), (2, 8, False)]):  # int8 signs, c
        jobs.append((tk._encode_kernel, dict(ints_ptr="*i64", floats_ptr=P, k=I32, total=I64,
                                             out_ptr=("*u8", "*i8", P)[mode], bad_ptr="*i32"),
                     dict(MODE=mode, EVEN=even, BITS=bits)))
    for bits in ((4,) if quick else (2, 4, 8)):
        jobs.append((tk._quantize_lanes_kernel, dict(c_ptr=P, out_ptr="*u8", n=I32, nbytes=I32, mult_ptr=P, s=F),
                     dict(BITS=bits)))
    for source, bits, skip in (((3, 4, False),) if quick else ((0, 8, False), (1, 1, False), (2, 1, False), (3, 2, False),
                                                              (3, 4, False), (3, 8, False), (4, 8, True))):
        jobs.append((tk._apply_kernel, dict(ints_ptr="*i64", floats_ptr=P, k=I32,
                                            u_ptr=P if source == 4 else "*i8" if source == 0 else "*u8",
                                            neg_ptr=P if source == 4 else "*u8", above=I32, below=I32,
                                            skip_ptr="*i32" if skip else P),
                     dict(SOURCE=source, BITS=bits, KMAX=16, SKIP=skip)))
    for even in ((True,) if quick else (True, False)):
        jobs.append((tk._vote_count_kernel, dict(packed_ptr="*u8", stride=I32, world=I32, nbytes=I32, half=I32,
                                                 gt_ptr="*u8", eq_ptr="*u8"), dict(EVEN=even)))
    rows = []
    for fn, sig, consts in jobs:
        consts = dict(consts, BLOCK=tk._BLOCK)
        sig = dict(sig, **{k: "constexpr" for k in consts})
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options=dict(tk._NO_CONTRACTION))
        rows.append((fn.__name__, {k: v for k, v in consts.items() if k != "BLOCK"}, round(time.perf_counter() - t0, 2),
                     len(k.asm["cubin"])))
    return rows


# ----------------------------------------------------------------------------- main
CHECKS = ("backend", "step_clock", "kernels_vs_cpu_reference", "kernels_vs_torch_cuda", "lion_cuda_vs_cpu",
          "lioncub_ws1_nccl", "nccl_ws1_calls", "device_paths_two_ranks", "gloo_two_ranks_cuda", "bandwidth")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, gloo, Triton's interpreter, tiny sizes")
    ap.add_argument("--budget-s", type=float, default=270.0, help="the whole run's time budget (default 270 s)")
    ap.add_argument("--checks", default="", help=f"comma-separated subset of {', '.join(CHECKS)} (default: all)")
    ap.add_argument("--only", action="append", default=[], metavar="PATH",
                    help="device_paths_two_ranks: run this path (exact name, or a prefix ending in *); repeatable")
    ap.add_argument("--inject", default="", help=f"tests of this script: comma-separated broken paths to add to "
                                                 f"device_paths_two_ranks ({', '.join(INJECT)}); each must fail")
    ap.add_argument("--compile-only", type=int, metavar="ARCH", help="compile the kernels for sm_ARCH (e.g. 90) and stop")
    ap.add_argument("--quick", action="store_true", help="with --compile-only: one specialization per kernel")
    args = ap.parse_args(argv)
    selected = [c for c in args.checks.split(",") if c] or list(CHECKS)
    inject = tuple(k for k in args.inject.split(",") if k)
    bad = [c for c in selected if c not in CHECKS] + [k for k in inject if k not in INJECT]
    if bad:
        ap.error(f"unknown check or injection: {', '.join(bad)}")
    _DEADLINE[0] = time.monotonic() + args.budget_s
    _BUDGET[0] = args.budget_s
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before lioncub.fused.triton is imported (the ranks inherit it)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None  # a copy of the tree without .git
    report = dict(command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                  started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=commit, host=platform.node(), python=platform.python_version(), torch=torch.__version__,
                  torch_cuda=torch.version.cuda, triton=triton_version, cuda_available=cuda,
                  gpus=torch.cuda.device_count() if cuda else 0,
                  device_name=torch.cuda.get_device_name(0) if cuda else None, dry_run=args.dry_run,
                  budget_s=args.budget_s, subset=None if selected == list(CHECKS) else selected,
                  paths_only=args.only or None, inject=list(inject) or None, checks={}, result=None)

    def write():
        path.write_text(json.dumps(report, indent=2) + "\n")

    if args.compile_only:
        rows = compile_all(args.compile_only, args.quick)
        report.update(result="compiled", compiled=[dict(kernel=r[0], spec=r[1], seconds=r[2], cubin_bytes=r[3])
                                                   for r in rows])
        write()
        print(f"compiled {len(rows)} kernels for sm_{args.compile_only} with Triton {triton_version}: {path}")
        return 0
    if not cuda and not args.dry_run:
        report["result"] = "no-cuda"
        write()
        print(f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing was "
              f"checked. Run this on a machine with a GPU (or --dry-run to check the script on CPU). Report: {path}")
        return 3
    if triton_version is None:
        report["result"] = "fail"
        report["checks"]["triton"] = dict(ok=False, error="triton is not importable: the CUDA path would run torch ops")
        write()
        print("FAIL: triton is not importable", flush=True)
        return 1
    device = "cpu" if args.dry_run else "cuda"
    if cuda and not args.dry_run:
        torch.cuda.set_device(0)
    n_bw, reps = (1 << 12, 2) if args.dry_run else (1 << 26, 20)
    print(f"gpu-check on {report['device_name'] or 'CPU (dry run, Triton interpreter)'}: torch {torch.__version__}, "
          f"triton {triton_version}; budget {args.budget_s:.0f} s; report: {path}", flush=True)
    runs = {"backend": lambda: check_backend(device),
            "step_clock": lambda: check_step_clock(device),
            "kernels_vs_cpu_reference": lambda: check_kernels_vs_cpu_reference(device),
            "kernels_vs_torch_cuda": lambda: check_kernels_vs_torch_cuda(device, n_bw >> 6),
            "lion_cuda_vs_cpu": lambda: check_lion_cuda_vs_cpu(device),
            "lioncub_ws1_nccl": lambda: check_lioncub_ws1(device),
            "nccl_ws1_calls": lambda: check_nccl_ws1_calls(device, args.dry_run),
            "device_paths_two_ranks": lambda: check_device_paths_two_ranks(device, args.only, inject),
            "gloo_two_ranks_cuda": lambda: check_gloo_two_ranks(device),
            "bandwidth": lambda: check_bandwidth(device, n_bw, reps, judged=not args.dry_run)}
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    name = None
    try:
        for name in selected:
            t0 = time.perf_counter()
            if _left() < 5:
                res = dict(ok=False, error=f"not run: the run's budget of {args.budget_s:.0f} s was spent")
            else:
                try:
                    res = runs[name]()
                except Exception:  # noqa: BLE001 - a crashed check is a failed check, with its traceback
                    res = dict(ok=False, error=traceback.format_exc().strip().splitlines()[-12:])
            res["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][name] = res
            write()
            brief = {k: v for k, v in res.items() if k not in ("rows", "paths", "passed")}
            print(f"{'ok  ' if res['ok'] else 'FAIL'} {name} ({res['seconds']} s)"
                  + ("" if res["ok"] else ": " + json.dumps(brief)[:3000]), flush=True)
    except (KeyboardInterrupt, SystemExit) as exc:  # SIGTERM (the time limit) or ^C: children are gone
        report["interrupted"] = f"{type(exc).__name__}: {exc} (during {name})"
        if name is not None:
            report["checks"][name] = dict(ok=False, error=f"interrupted: {type(exc).__name__}: {exc}")
        print(f"INTERRUPTED during {name}: {exc}", flush=True)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if "gloo_two_ranks_cuda" in report["checks"]:
        report["gloo_cuda_collectives"] = report["checks"]["gloo_two_ranks_cuda"].get("collectives")
    failed = [k for k, v in report["checks"].items() if not v["ok"]]
    missing = [c for c in selected if c not in report["checks"]]
    report["result"] = "fail" if failed or missing or "interrupted" in report else "pass"
    report["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write()
    summary = ("FAILED: " + ", ".join(failed + [f"{m} (not run)" for m in missing]) if report["result"] == "fail"
               else "all checks passed" + (f" (subset: {', '.join(selected)})" if report["subset"] else ""))
    print(summary, f"({path})", flush=True)
    return 0 if report["result"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
