"""Every bench script that writes a table re-makes it from its committed JSON with ``--report-only``,
running nothing (issue 46: a headline figure is its JSON plus this command; bench/README.md's table).

Each script reads a copy in a temporary directory (race, step_time and memory write their report back
beside the JSON). A JSON that is not there (renamed, deleted) fails, everywhere: the results are committed
files of this repository, not something a machine may lack (tests/conftest.py's LIONCUB_REQUIRE is for those).
"""
from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"

# (script, its committed JSON, argv with {json} for the copy, a line its table must print)
CASES = (
    ("kernels", "kernels.json", ["--report-only", "{json}"], "fused encode m,g -> 1-bit"),
    ("opt_step", "opt_step.json", ["--report-only", "{json}"], "onebit     step"),
    ("opt_step_ab", "opt_step_before_after_issue46.json", ["--report-only", "{json}"], "before ms (median of runs)"),
    ("vote_bench", "vote_bench.json", ["--report-only", "{json}"], "grad fp32 allreduce"),
    ("device_audit", "device_audit.json", ["--report-only", "{json}"], "| lioncub grad |"),
    ("local_grid", "local_grid.json", ["--report-only", "{json}"], "| grid3 | lcub-mean8-h50-nest0.7-ef-adamw | 0.001 |"),
    ("net_probe", "net_probe.json", ["--report-only", "{json}"], "calibrate()"),
    ("nodes", "nodes.json", ["--report-only", "{json}"], "lion fp32 flat"),
    ("nodes_convergence", "nodes_convergence.json", ["--report-only", "{json}"], "| `onebit` | flat | 2.568 |"),
    ("overlap", "overlap.json", ["--report-only", "{json}"], "pbit 4"),
    ("soak", "soak.json", ["--report-only", "{json}"], "replicas identical: True"),
    ("vote_agreement", "vote_agreement.json", ["--report-only", "{json}", "--study", str(RESULTS / "study_recipe.jsonl")],
     "| B=12 1-bit lr=0.0001 | 0-400 |"),
    ("worker_start", "worker_start.json", ["--report-only", "{json}"], "| workers | spawn (median s) |"),
    ("round_cpu", "round_cpu.json", ["--report-only", "{json}"], "| lcub-smean2-h15-sgd1-ef-adamw-stream-f5 | 18.35 |"),
    ("study", "study_recipe.jsonl", ["--report-only", "{json}"], "| Lion lr=0.0001 wd=1 | 3 | 2000 | 2.1239 ± 0.0104 |"),
    ("study_ab", "study_ab_issue64.json", ["--report-only", "{json}"], "| 1-bit (onebit) | 4.256273 | 4.256273 | yes |"),
    ("fault_tolerance", "fault_tolerance.json", ["--report-only", "{json}"], "| 0 | 5 |"),
    ("import_graph", "import_graph_issue46.json", ["--report-only", "--out", "{json}"], "upward"),
    ("memory", "memory.json", ["--report-only", "--out", "{json}", "--md", "{dir}/memory.md"], "| 70B | fsdp_lioncub_onebit |"),
    # these two redraw their plot too (matplotlib): seconds each
    pytest.param("step_time", "step_time.json", ["--report-only", "--out", "{json}"], "lion fp32 ", marks=pytest.mark.slow),
    pytest.param("race", "race_100mbit.json", ["--report-only", "{json}"], "| diloco-h50 |", marks=pytest.mark.slow),
)


def _script(case) -> str:
    return getattr(case, "values", case)[0]  # a pytest.param's values, or the plain tuple


@pytest.mark.parametrize("script, name, argv, line", CASES, ids=[_script(c) for c in CASES])
def test_report_only_remakes_the_table_from_the_committed_json(tmp_path, capsys, script, name, argv, line):
    """Fails if a script's --report-only cannot read its own committed JSON or prints another table."""
    committed = RESULTS / name
    assert committed.is_file(), f"bench/results/{name} is gone: its table cannot be re-made (rename it here too)"
    copy = tmp_path / name
    shutil.copy(committed, copy)
    module = importlib.import_module(f"bench.{script}")
    code = module.main([a.format(json=copy, dir=tmp_path) for a in argv])
    assert code in (None, 0)
    out = capsys.readouterr().out
    assert line in out, out[-2000:]


def test_every_table_script_has_a_report_only():
    """Every bench script that writes a JSON of results takes --report-only (the ones that do not: the
    shared helpers, the study's plan and its report and the race's and memory's reports, which only read)."""
    bench = RESULTS.parent
    helpers = {"__init__", "_runner", "_fakemem", "regime", "study_plan", "study_report", "race_report",
               "memory_report"}
    scripts = {p.stem for p in bench.glob("*.py")} - helpers
    assert scripts == {_script(c) for c in CASES}
    assert all("--report-only" in (bench / f"{s}.py").read_text() for s in scripts)
