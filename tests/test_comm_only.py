"""Every collective goes through ``lioncub.comm`` (NCCL: tensors on the parameters' device,
barriers naming the device, object collectives as JSON bytes on that device).

A static check: an AST scan of every ``.py`` under ``src/lioncub`` finds no use of a
``torch.distributed`` collective outside ``src/lioncub/comm.py``, whatever the import alias
(``dist.x``, ``torch.distributed.x``, ``from torch.distributed import x``, ``distributed_c10d``).
The scanner itself is tested on files holding violations, and comm's JSON object collectives
on a real 2-process gloo group.
"""
from __future__ import annotations

import ast
import pathlib
import textwrap

import torch

from tests.dist import run_workers

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "lioncub"
ALLOWED = {SRC / "comm.py"}

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single",
    "broadcast", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send",
    "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "monitored_barrier", "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
})
# the modules that define them (torch.distributed re-exports distributed_c10d's)
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
FORBIDDEN = frozenset(f"{m}.{n}" for m in DIST_MODULES for n in COLLECTIVES)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted path it is bound to by an import anywhere in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name  # import torch.distributed as dist
                else:
                    head = a.name.split(".")[0]
                    names[head] = head  # import torch.distributed binds 'torch'
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.name != "*":
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted path an expression names (``dist.all_reduce`` -> ``torch.distributed.all_reduce``)."""
    if isinstance(node, ast.Name):
        # 'dist' not bound by an import (a file that forgot it, a snippet) is read as torch.distributed
        return names.get(node.id, "torch.distributed" if node.id == "dist" else None)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def collective_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every use of a ``torch.distributed`` collective in ``source``: ``'file:line: dotted.name'``.

    A use is a reference through any alias (called or not: ``f = dist.all_reduce`` counts),
    a ``from torch.distributed import <collective>``, or a star import of torch.distributed."""
    tree = ast.parse(source, filename=filename)
    names = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES and node.level == 0:
            for a in node.names:
                if a.name == "*" or a.name in COLLECTIVES:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
        elif isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
            path = _dotted(node, names)
            if path in FORBIDDEN:
                found.append((node.lineno, path))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def scan(paths) -> list[str]:
    """:func:`collective_uses` over the files ``paths``."""
    out = []
    for path in sorted(paths):
        out += collective_uses(pathlib.Path(path).read_text(), str(path))
    return out


def _library_files():
    return [p for p in SRC.rglob("*.py") if p not in ALLOWED]


def test_only_comm_calls_collectives():
    files = _library_files()
    assert len(files) > 20  # the scan sees the package
    found = scan(files)
    assert not found, ("torch.distributed collectives outside lioncub/comm.py (use the lioncub.comm wrappers, "
                       "with tensors on the parameters' device):\n" + "\n".join(found))


def test_scanner_sees_comm_py_itself():
    """comm.py does call torch.distributed's collectives: only its exemption lets the check pass."""
    found = scan([SRC / "comm.py"])
    assert any(u.endswith("torch.distributed.all_reduce") for u in found), found
    assert any(u.endswith("torch.distributed.barrier") for u in found), found


VIOLATIONS = {
    "dist_alias.py": ("import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n",
                      ["torch.distributed.all_reduce"]),
    "bare_dist.py": ("def f(t):\n    dist.all_reduce(t)\n", ["torch.distributed.all_reduce"]),
    "full_path.py": ("import torch\ndef f(t):\n    torch.distributed.broadcast(t, src=0)\n",
                     ["torch.distributed.broadcast"]),
    "import_sub.py": ("import torch.distributed\ntorch.distributed.barrier()\n", ["torch.distributed.barrier"]),
    "from_torch.py": ("from torch import distributed as D\nD.all_gather_object([None], 1)\n",
                      ["torch.distributed.all_gather_object"]),
    "from_import.py": ("from torch.distributed import all_to_all_single as a2a\ndef f(o, t):\n    a2a(o, t)\n",
                       ["from torch.distributed import all_to_all_single", "torch.distributed.all_to_all_single"]),
    "c10d.py": ("from torch.distributed import distributed_c10d as c10d\nc10d.send(t, 1)\n",
                ["torch.distributed.distributed_c10d.send"]),
    "referenced.py": ("import torch.distributed as td\ngather = td.all_gather_into_tensor\n",
                      ["torch.distributed.all_gather_into_tensor"]),
    "in_lambda.py": ("import torch.distributed as dist\nrun = lambda t: dist.broadcast_object_list([t])\n",
                     ["torch.distributed.broadcast_object_list"]),
    "star.py": ("from torch.distributed import *\n", ["from torch.distributed import *"]),
}


def test_scanner_flags_each_violation(tmp_path):
    for name, (source, expected) in VIOLATIONS.items():
        path = tmp_path / name
        path.write_text(source)
        found = scan([path])
        assert [u.split(": ", 1)[1] for u in found] == expected, (name, found)
    # the same check as the library test, over a tree holding one violation: it fails
    (tmp_path / "clean.py").write_text("x = 1\n")
    assert len(scan(tmp_path.glob("*.py"))) == sum(len(e) for _, e in VIOLATIONS.values())


def test_scanner_passes_allowed_uses(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text(textwrap.dedent("""\
        import torch.distributed as dist
        from lioncub import comm
        from torch.distributed import ReduceOp, get_rank

        def f(t, group, device, handle):
            comm.all_reduce(t, group, op="max")
            comm.barrier(group, device)
            comm.broadcast(t, group, src=0)
            comm.all_gather_object({"a": 1}, group, device)
            handle.all_reduce(t)          # some other object's method
            all_reduce = comm.all_reduce  # a local name, not torch.distributed's
            all_reduce(t)
            return dist.get_rank(group), dist.get_world_size(), dist.ReduceOp.SUM, ReduceOp.MAX, get_rank()
        """))
    assert scan([path]) == []


# ------------------------------------------------------------- object collectives on gloo
def _objects_worker(rank, world):
    from lioncub import comm

    device = torch.device("cpu")
    mine = {"rank": rank, "pair": (rank, f"r{rank}"), "nested": [(1, 2), {"x": (3.5, None)}], "s": "é" * rank}
    everyone = comm.all_gather_object(mine, None, device)
    first = comm.broadcast_object(mine, None, device, src=0)
    last = comm.broadcast_object(("from", rank), None, device, src=world - 1)
    plain = comm.all_gather_object(rank * 10, None, device)
    none = comm.broadcast_object(None if rank == 0 else "ignored", None, device, src=0)
    return {"everyone": everyone, "first": first, "last": last, "plain": plain, "none": none}


def test_object_collectives_on_gloo():
    world = 2
    results = run_workers(_objects_worker, world)
    as_list = [{"rank": r, "pair": [r, f"r{r}"], "nested": [[1, 2], {"x": [3.5, None]}], "s": "é" * r}
               for r in range(world)]
    for rank, res in enumerate(results):
        assert res["everyone"] == as_list, (rank, res["everyone"])  # in rank order, tuples as lists
        assert isinstance(res["everyone"][1]["pair"], list)
        assert res["first"] == as_list[0]
        assert res["last"] == ["from", world - 1] and isinstance(res["last"], list)
        assert res["plain"] == [0, 10]
        assert res["none"] is None
