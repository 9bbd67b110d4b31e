"""docs/api.md's composition table, cell by cell: {LionCub, LocalCub} × {replicated, FSDP2, ranks per node} ×
{plain, torchft} × each aggregation either runs or is refused in one line saying why.

A plain cell that runs takes 10 steps on 2 gloo ranks (LocalCub: one round of H = 10) and must leave the replicas
identical; its exactness against a reference is each layout's own test (tests/test_sharded.py,
tests/test_hierarchy_reference.py, tests/test_scatter_reference.py, ...). A torchft cell runs in a world of one
rank (a replica is one worker) with a stand-in manager: "runs" there means every check passed and the optimizer
went on to register its state with the manager; tests/test_ft.py runs the real lighthouse.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lioncub
from tests.dist import run_workers

ROOT = Path(__file__).resolve().parents[1]
AGGREGATIONS = ("Mean", "SignVote", "OneBitMean", "LaneMean", "ScatterMean")
LAYOUTS = ("replicated", "FSDP2", "ranks per node")


class _Accepted(Exception):
    """Raised by the stand-in manager when the optimizer registers its state: every check passed."""


class _Manager:
    _use_async_quorum = False

    def register_state_dict_fn(self, *args):
        raise _Accepted()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _build(opt_name, layout, agg_name, world, manager=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    kw = dict(aggregation=getattr(lioncub, agg_name)())
    if layout == "FSDP2":
        model = fully_shard(model, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))[
            "shard"])
    elif layout == "ranks per node":
        kw["process_group"] = lioncub.node_groups(local_size=1)
    if manager is not None:
        kw["manager"] = manager
    cls = getattr(lioncub, opt_name)
    return model, cls(model.parameters(), lr=1e-2, **kw)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _plain_cells(rank, world):
    import torch.distributed as dist

    out = {}
    for opt_name in ("LionCub", "LocalCub"):
        for layout in LAYOUTS:
            for agg in AGGREGATIONS:
                try:
                    model, opt = _build(opt_name, layout, agg, world)
                except (ValueError, TypeError) as exc:
                    out[f"{opt_name}|{layout}|plain|{agg}"] = f"refused: {exc}"
                    continue
                g = torch.Generator().manual_seed(rank)
                for _ in range(10):
                    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                flat = torch.cat([_local(p).detach().reshape(-1) for p in model.parameters()])
                got = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(got, flat)
                same = all(torch.equal(got[0], t) for t in got)
                out[f"{opt_name}|{layout}|plain|{agg}"] = "runs" if same else "runs, replicas differ"
    return out


def _ft_cells(rank, world):
    out = {}
    for opt_name in ("LionCub", "LocalCub"):
        for layout in LAYOUTS:
            for agg in AGGREGATIONS:
                key = f"{opt_name}|{layout}|torchft|{agg}"
                try:
                    _build(opt_name, layout, agg, world, manager=_Manager())
                    out[key] = "no manager call"
                except _Accepted:
                    out[key] = "runs"
                except (ValueError, TypeError) as exc:
                    out[key] = f"refused: {exc}"
    return out


def probe_cells() -> dict:
    """Every cell's outcome: ``'runs'`` or ``'refused: <the error>'``."""
    out = run_workers(_plain_cells, 2, timeout_s=240)[0]
    out.update(run_workers(_ft_cells, 1, timeout_s=120)[0])
    return out


def documented_cells() -> tuple[dict, dict]:
    """docs/api.md's table: {cell key: '✓' or a reason number}, and {reason number: the words it quotes}."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## What composes"):]
    cells = {}
    for row in re.findall(r"^\| (LionCub|LocalCub) \| ([^|]+?) \| (plain|torchft) \|(.+)\|$", section, re.M):
        opt_name, layout, ft, rest = row
        marks = [c.strip() for c in rest.split("|")]
        assert len(marks) == len(AGGREGATIONS), row
        for agg, mark in zip(AGGREGATIONS, marks):
            cells[f"{opt_name}|{layout}|{ft}|{agg}"] = mark
    reasons = dict(re.findall(r"^(\d+)\. .*?`([^`]+)`", section, re.M))
    return cells, reasons


def test_every_cell_of_the_composition_table_runs_or_is_refused_as_documented():
    cells, reasons = documented_cells()
    assert len(cells) == 2 * len(LAYOUTS) * 2 * len(AGGREGATIONS), len(cells)
    got = probe_cells()
    assert set(got) == set(cells)
    for key, mark in cells.items():
        outcome = got[key]
        if mark == "✓":
            assert outcome == "runs", (key, outcome)
        else:
            assert outcome.startswith("refused: ") and "\n" not in outcome, (key, outcome)
            assert reasons[mark] in outcome, (key, reasons[mark], outcome)


@pytest.mark.parametrize("mark, want", [("✓", 21), ("refused", 39)])
def test_the_table_counts_its_cells(mark, want):
    """The count the note quotes: cells that run, cells refused (each with its reason)."""
    cells, _ = documented_cells()
    n = sum(1 for m in cells.values() if (m == "✓") == (mark == "✓"))
    assert n == want, (mark, n)
