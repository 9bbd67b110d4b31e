#!/usr/bin/env python3
"""The package's shape, before and after a change: modules, imports, imports that climb the layers,
import circles, classes over 250 lines, and branches on a vote method's name or an ``aggregate``
outside ``votes/`` (issue 46's measures). Reads source only (nothing is imported).

    python3 bench/import_graph.py --src /tmp/before/src --src src --out bench/results/import_graph_issue46.json
    python3 bench/import_graph.py --report-only --out bench/results/import_graph_issue46.json

The layers are tests/test_layout.py's (the floors this tree enforces), applied to every tree given.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests import test_layout as layout  # noqa: E402  (its layer rule and import resolver)

SWITCH = re.compile(r"""(==|!=)\s*["'](mean|onebit|pbit|gather|sign_allreduce|l1|linf)["']""")
"""A comparison of a value with a vote method's name, a quantizer's, or ``'mean'`` (an aggregate)."""
OUTSIDE_VOTES = ("engine", "optim", "ft", "harness", "ddp")


def shape(src: str) -> dict:
    root = pathlib.Path(src).resolve() / "lioncub"
    layout.SRC = root
    files = sorted(root.rglob("*.py"))
    names = {layout._module_name(f)[0] for f in files}
    graph: dict[str, set[str]] = {}
    upward = []
    for f in files:
        name, _ = layout._module_name(f)
        targets = set()
        for line, target in layout.imports_of(f):
            while target and target not in names:  # a name imported from a module: the module
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
            try:
                mine, theirs = layout.layer_of(name), layout.layer_of(target)
            except AssertionError:  # a module this tree's rule has no floor for (e.g. a removed shim)
                continue
            if layout.LAYERS.index(theirs) > layout.LAYERS.index(mine):
                upward.append(f"{name}:{line} ({mine}) -> {target} ({theirs})")
        graph[name] = targets
    big, switches = [], []
    for f in files:
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                big.append(f"{layout._module_name(f)[0]}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
        rel = f.relative_to(root).parts
        if rel[0] in OUTSIDE_VOTES:
            for k, line in enumerate(text.splitlines(), 1):
                if SWITCH.search(line) and not line.lstrip().startswith("#"):
                    switches.append(f"{'/'.join(rel)}:{k}: {line.strip()}")
    return dict(src=src, modules=len(graph), imports=sum(len(t) for t in graph.values()),
                root_modules=sorted(n for n in names if "." not in n and n), upward=upward,
                circles=[sorted(c) for c in _circles(graph)], big_classes=big, name_switches=switches)


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report(rows: list[dict]) -> str:
    lines = [f"{'tree':28s} {'modules':>7s} {'imports':>7s} {'root':>5s} {'upward':>6s} {'circles':>7s} "
             f"{'>250':>5s} {'switches':>8s}"]
    for r in rows:
        lines.append(f"{r['src'][-28:]:28s} {r['modules']:7d} {r['imports']:7d} {len(r['root_modules']):5d} "
                     f"{len(r['upward']):6d} {len(r['circles']):7d} {len(r['big_classes']):5d} "
                     f"{len(r['name_switches']):8d}")
    for r in rows:
        lines.append(f"\n{r['src']}:")
        for key in ("upward", "circles", "big_classes", "name_switches"):
            for item in r[key]:
                lines.append(f"  {key}: {item}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", action="append", default=[], help="a tree's src/ (give several: before, after)")
    ap.add_argument("--out", default=str(HERE / "results" / "import_graph.json"))
    ap.add_argument("--report-only", action="store_true", help="print the table of an existing --out")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            rows = json.load(f)
    else:
        rows = [shape(s) for s in (args.src or ["src"])]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
