"""Run tests/test_triton.py's kernel checks without pytest (``make gpu-check`` on a bare GPU machine).

Imports the test file (as ``tests.test_triton``, which makes pytest optional) and calls every ``test_*`` function
whose only arguments are its recorded cases (``tests.test_triton.cases``: one call per value) or that takes none;
a function that needs one of pytest's fixtures (``tmp_path``, ``capsys``) is listed as not run. Writes one JSON
object to stdout: passed, failed (each with the last lines of its traceback), skipped, not run. Exit status 0 when
nothing failed and something ran.

    LIONCUB_TEST_DEVICE=cuda python3 tests/gpu/kernel_runner.py      # the compiled kernels on the GPU
    TRITON_INTERPRET=1 python3 tests/gpu/kernel_runner.py            # the interpreter, CPU tensors
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(module, only: str = "") -> dict:
    """Every runnable ``test_*`` of ``module`` (whose name contains ``only``), each of its cases once: the outcome by
    case name."""
    passed, failed, skipped, not_run = [], {}, {}, []
    for name, fn in sorted(vars(module).items()):
        if not (name.startswith("test_") and callable(fn) and only in name):
            continue
        arg, values = getattr(fn, "cases", (None, [None]))
        if set(inspect.signature(fn).parameters) - ({arg} if arg else set()):
            not_run.append(name)
            continue
        for value in values:
            label = name if arg is None else f"{name}[{value}]"
            try:
                fn(**({arg: value} if arg else {}))
                passed.append(label)
            except module.SkipCase as why:
                skipped[label] = str(why)
            except Exception:  # noqa: BLE001 - every failure is reported, the others still run
                failed[label] = traceback.format_exc().strip().splitlines()[-6:]
    return dict(passed=passed, failed=failed, skipped=skipped, not_run=not_run)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the tests whose name contains this")
    ap.add_argument("--without-pytest", action="store_true", help="hide pytest even where it is installed")
    args = ap.parse_args(argv)
    if args.without_pytest:
        sys.modules["pytest"] = None  # `import pytest` now raises ImportError, as on a machine without it
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]
    report = run(importlib.import_module("tests.test_triton"), args.only)
    print(json.dumps(report))
    return 0 if report["passed"] and not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
