"""Run the Triton kernel tests without pytest (``make gpu-check`` on a bare GPU machine).

Imports every ``tests/test_triton*.py`` (as ``tests.test_triton``, ``tests.test_triton_encode``, ...: their shared
``tests/triton_cases.py`` makes pytest optional) and calls every ``test_*`` function whose only arguments are its
recorded cases (``tests.triton_cases.cases``: one call per value) or that takes none; a function that needs one of
pytest's fixtures (``tmp_path``, ``capsys``) is listed as not run. Writes one JSON object to stdout: passed, failed
(each with the last lines of its traceback), skipped, not run. Exit status 0 when nothing failed and something ran.
``--list`` writes the cases it would run (and those it would not) without running them.

    LIONCUB_TEST_DEVICE=cuda python3 tests/gpu/kernel_runner.py      # the compiled kernels on the GPU
    TRITON_INTERPRET=1 python3 tests/gpu/kernel_runner.py            # the interpreter, CPU tensors
    python3 tests/gpu/kernel_runner.py --list                        # what it would run
"""
from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_modules() -> list[str]:
    """The kernel test files, as modules: ``tests/test_triton*.py``."""
    names = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "tests", "test_triton*.py")))
    return [f"tests.{name}" for name in names]


def collect(modules, only: str = "") -> tuple[list, list]:
    """``(runnable, not_run)``: every ``test_*`` of ``modules`` whose name contains ``only``, as (label, function,
    keyword arguments) per case; the names of those that need pytest's fixtures. A name in two modules is an
    error (the labels would not say which ran)."""
    runnable, not_run, seen = [], [], {}
    for module in modules:
        for name, fn in sorted(vars(module).items()):
            if not (name.startswith("test_") and callable(fn) and only in name):
                continue
            if seen.setdefault(name, module.__name__) != module.__name__:
                raise ValueError(f"{name} is in both {seen[name]} and {module.__name__}")
            arg, values = getattr(fn, "cases", (None, [None]))
            if set(inspect.signature(fn).parameters) - ({arg} if arg else set()):
                not_run.append(name)
                continue
            runnable += [(name if arg is None else f"{name}[{value}]", fn, {arg: value} if arg else {})
                         for value in values]
    return runnable, not_run


def run(modules, only: str = "") -> dict:
    """Every runnable ``test_*`` of ``modules`` (whose name contains ``only``), each of its cases once: the outcome
    by case name."""
    from tests.triton_cases import SkipCase

    runnable, not_run = collect(modules, only)
    passed, failed, skipped = [], {}, {}
    for label, fn, kwargs in runnable:
        try:
            fn(**kwargs)
            passed.append(label)
        except SkipCase as why:
            skipped[label] = str(why)
        except Exception:  # noqa: BLE001 - every failure is reported, the others still run
            failed[label] = traceback.format_exc().strip().splitlines()[-6:]
    return dict(passed=passed, failed=failed, skipped=skipped, not_run=not_run)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the tests whose name contains this")
    ap.add_argument("--without-pytest", action="store_true", help="hide pytest even where it is installed")
    ap.add_argument("--list", action="store_true", help="list the cases (and the tests not run) without running them")
    args = ap.parse_args(argv)
    if args.without_pytest:
        sys.modules["pytest"] = None  # `import pytest` now raises ImportError, as on a machine without it
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]
    modules = [importlib.import_module(name) for name in test_modules()]
    if args.list:
        runnable, not_run = collect(modules, args.only)
        print(json.dumps(dict(cases=[label for label, _, _ in runnable], not_run=not_run)))
        return 0 if runnable else 1
    report = run(modules, args.only)
    print(json.dumps(report))
    return 0 if report["passed"] and not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
