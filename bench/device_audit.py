#!/usr/bin/env python3
"""The device audit of every optimizer path: collectives off the parameters' device, dtypes and
reduce ops NCCL lacks, host syncs per step and inside backward (docs/gpu.md).

Runs :data:`lioncub.testing.paths.PATHS` with parameters on ``meta`` in a 2-rank fake process
group (one process, no GPU), each under :class:`lioncub.testing.audit.DeviceAudit`, and writes a
table (``--md``) and the raw rows (``--out``, JSON). ``tests/test_device_audit.py`` asserts the
same rows in the default suite.

    PYTHONPATH=src python3 bench/device_audit.py --out bench/results/device_audit.json \
        --md bench/results/device_audit.md
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _legacy_drive(phase, t):
    """Values for code written before the zero-is-ordinary convention (the 'before' table of
    issue 30): bool reads answer True (finite, equal), the old has-grad vector 1s with its
    trailing non-finite count 0, everything else 0."""
    import torch

    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=t.dtype)
    if t.dtype == torch.uint8 and t.dim() == 1 and t.numel() > 1:
        out = torch.ones(t.shape, dtype=t.dtype)
        out[-1] = 0
        return out
    return None


def audit_path(name: str, run, world_size: int = 2, legacy: bool = False) -> dict:
    """One path under the audit; the row of the report."""
    import torch

    from lioncub.testing.audit import DeviceAudit

    audit = DeviceAudit(torch.device("meta"), drive=_legacy_drive if legacy else None)
    error = None
    try:
        with audit:
            run(torch.device("meta"), audit)
    except Exception as exc:  # a path that cannot run on the device is a finding, not a crash
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    per = audit.syncs_per_phase()
    steps = {k: n for k, n in per.items() if k.startswith("step")}
    worst = max(steps, key=steps.get) if steps else None
    return {"path": name, **audit.summary(), "error": error,
            "violation_lines": audit.violations[:5],
            "worst_step_syncs": [f"{s.name} at {s.where}" for s in audit.syncs if s.phase == worst]}


def init_fake(world_size: int = 2) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def table(rows: list[dict], budget: dict) -> str:
    out = ["| path | collectives | violations | max host syncs / step (budget) | syncs in backward | error |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        b = budget.get(r["path"], "")
        out.append(f"| {r['path']} | {r['collectives']} | {r['violations']} | {r['max_syncs_per_step']} ({b}) | "
                   f"{r['syncs_in_backward']} | {r['error'] or ''} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON rows")
    ap.add_argument("--md", help="markdown table")
    ap.add_argument("--only", default="", help="comma-separated substrings of path names")
    ap.add_argument("--legacy-values", action="store_true",
                    help="answer host reads as code before issue 30 expects (for the 'before' table)")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from lioncub.testing.paths import META_SKIP, PATHS, SYNC_BUDGET

    if args.report_only:
        print(table(json.loads(Path(args.report_only).read_text()), SYNC_BUDGET), end="")
        return 0

    init_fake()
    rows = []
    for name, run in PATHS.items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        if name in META_SKIP:
            print(f"{name:40s} not run on meta: {META_SKIP[name]}")
            continue
        row = audit_path(name, run, legacy=args.legacy_values)
        rows.append(row)
        print(f"{name:40s} violations={row['violations']:3d} syncs/step={row['max_syncs_per_step']:2d} "
              f"(budget {SYNC_BUDGET.get(name)}) backward={row['syncs_in_backward']} {row['error'] or ''}", flush=True)
    text = table(rows, SYNC_BUDGET)
    if args.md:
        Path(args.md).write_text(text)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["violations"] or r["error"] or r["syncs_in_backward"]
           or r["max_syncs_per_step"] > SYNC_BUDGET.get(r["path"], 1)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
