"""The package layout's one rule (docs/design.md §7): imports run down the layers, never up.

Every import in ``src/lioncub`` (module level or inside a function, relative or absolute) is
resolved to the module it names and both ends are placed in a layer; an import of a higher
layer fails the test, naming the file, the line and both layers.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "lioncub"

LAYERS = ["base", "wire", "fused", "votes", "specs", "engine", "optim", "ddp", "api", "instruments", "testbed", "baselines",
          "testing", "harness", "ft", "cli"]
"""The library's floors (base .. ddp), the package's public names (``lioncub/__init__.py``), then the
tools' floors: the paper's instruments, the emulated cluster and launcher, the peers we race, the
device audit and the paths it runs (peers included), the harness, torchft, the command."""
BASE = {"comm", "chunks", "validate", "quantize", "lion"}
SPECS = {"aggregations", "options"}
"""The public setting objects (the aggregations, Options, Outer, Streaming): above the votes they name, below the
engine and the optimizers that take them."""
PACKAGES = {"wire": "wire", "fused": "fused", "votes": "votes", "engine": "engine", "optim": "optim", "ddp": "ddp",
            "": "api", "testing": "testing", "instruments": "instruments", "testbed": "testbed",
            "baselines": "baselines", "harness": "harness", "ft": "ft", "cli": "cli"}


def layer_of(module: str) -> str:
    """The layer of ``module`` (dotted, under lioncub; '' is the package root)."""
    head = module.split(".")[0]
    if head in BASE:
        return "base"
    if head in SPECS:
        return "specs"
    if head in PACKAGES:
        return PACKAGES[head]
    if not (SRC / f"{head}.py").exists() and not (SRC / head).is_dir():
        return "api"  # a name the package root defines or re-exports (``from lioncub import LionCub``)
    raise AssertionError(f"lioncub.{module} has no layer: add it to LAYERS / PACKAGES in tests/test_layout.py")


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module under lioncub) for every import of the package in ``path``."""
    name, is_pkg = _module_name(path)
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    package = [p for p in package if p]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "lioncub":
                target = node.module.split(".")[1:]
            else:
                continue
            if node.module is None or (node.level == 0 and not target):  # from . import a, b: the names
                for alias in node.names:
                    found.append((node.lineno, ".".join(target + [alias.name])))
            else:
                found.append((node.lineno, ".".join(target)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lioncub":
                    found.append((node.lineno, ".".join(alias.name.split(".")[1:])))
    return found


def test_imports_run_down_the_layers():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        name, _ = _module_name(path)
        mine = LAYERS.index(layer_of(name))
        for line, target in imports_of(path):
            theirs = LAYERS.index(layer_of(target))
            if theirs > mine:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]})")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a votes module importing the engine is reported."""
    fake = tmp_path / "lioncub"
    (fake / "votes").mkdir(parents=True)
    (fake / "votes" / "bad.py").write_text("from ..engine.step import Bucket\nfrom .. import comm\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    found = imports_of(fake / "votes" / "bad.py")
    assert found == [(1, "engine.step"), (2, "comm")]
    assert [layer_of(t) for _, t in found] == ["engine", "base"]
    with pytest.raises(AssertionError, match=r"votes/bad.py:1 \(votes\) imports engine.step \(engine\)"):
        test_imports_run_down_the_layers()


def test_the_rule_catches_a_tool_importing_the_command(tmp_path, monkeypatch):
    """The tools' floors: torchft's command reaching into the ``lioncub`` command (the circle
    ``cli`` <-> ``ft.command`` this rule now forbids) and the harness into torchft are reported."""
    fake = tmp_path / "lioncub"
    for sub in ("ft", "harness"):
        (fake / sub).mkdir(parents=True)
    (fake / "ft" / "command.py").write_text("def f():\n    from ..cli import testbed_unavailable\n")
    (fake / "harness" / "train.py").write_text("from ..ft import FTLocalCub\nfrom ..testbed import spawn\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError) as err:
        test_imports_run_down_the_layers()
    assert [line.strip() for line in str(err.value).splitlines()[1:3]] == ["ft/command.py:2 (ft) imports cli (cli)",
                                                 "harness/train.py:1 (harness) imports ft (ft)"]


def test_no_module_at_the_root_but_the_base_and_the_tools():
    """The package root holds the base modules, the instruments and the command only (the old
    one-release module paths are gone: CHANGELOG.md)."""
    names = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert names == BASE | SPECS | {"instruments", "cli"}


def test_no_circle_no_class_past_250_lines_no_name_switch_outside_votes(tmp_path):
    """bench/import_graph.py on this tree: no import circle, no class over 250 lines, and no comparison
    with a vote method's name or an aggregate's in engine/, optim/, ft/, harness/ or ddp/ (the variants
    own their options and refusals in votes/)."""
    import json
    import subprocess

    out = tmp_path / "graph.json"
    root = SRC.parents[1]
    subprocess.run([sys.executable, str(root / "bench" / "import_graph.py"), "--src", str(SRC.parent), "--out", str(out)],
                   check=True, capture_output=True, cwd=root)
    (shape,) = json.loads(out.read_text())
    assert shape["modules"] > 50 and shape["imports"] > 100  # it read the package
    assert (shape["upward"], shape["circles"], shape["big_classes"], shape["name_switches"]) == ([], [], [], [])
