"""The fake-tensor machinery behind ``bench/memory.py``: one process playing rank 0 of a fake process group,
host reads answered, LionCub's C loops stood in for, and torch's ``MemTracker`` taught to keep each phase's
peak and the ``file:line`` that allocated each of the optimizer's storages. ``memory.py`` runs the setups
and writes the tables; this module only measures.

``LIONCUB_SRC``: another tree's ``src/`` to measure (a "before" table); default this repository's."""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("LIONCUB_SRC", ROOT / "src"))  # another tree's src/ (a "before" table): LIONCUB_SRC=...
sys.path.insert(0, str(SRC))
LIBRARY = str(SRC / "lioncub") + os.sep

class HostReads(TorchDispatchMode):
    """Inside FakeTensorMode: answer every host read of a fake tensor (``aten._local_scalar_dense``:
    ``item``, ``tolist``, ``bool``) with 0 (``False``; 1.0 for a floating-point tensor: a step count
    or a scale, which a caller may divide by; but 0.0 for the first element of the finite agreement's
    float64 vector, :func:`lioncub.engine.guard.agree`: its count of ranks with a non-finite value),
    and run ops whose tensors are all real as they are.
    ``reads`` counts the answers; ``where`` the library line of each (``file:line``: count)."""

    _LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.where: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_flatten

        if any(not issubclass(t, FakeTensor) for t in types):  # a DTensor: let it run its local ops first
            return NotImplemented  # (as MemTracker does, or they pass under the tracker unseen)
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        fake = [t for t in tensors if isinstance(t, FakeTensor)]
        if tensors and not fake and func not in self._LIFT:  # e.g. a DeviceMesh's rank table
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and fake:
            self.reads += 1
            where = library_frame()
            self.where[where] = self.where.get(where, 0) + 1
            t = fake[0]
            if t.is_floating_point() and where.startswith("lioncub/engine/guard.py") and t.storage_offset() == 0:
                return 0.0  # (a round's agreement: its head follows the count, which must read "all finite")
            return False if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 0
        return func(*args, **kwargs)


def library_frame(tb=None) -> str:
    """``file:line`` (relative to src/) of the innermost frame in src/lioncub (of ``tb``, a traceback,
    or of the current stack), or ``'?'``."""
    if tb is not None:
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(tb)]
    else:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.insert(0, (frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
    for filename, line in reversed(frames):
        path = os.path.abspath(filename)
        if path.startswith(LIBRARY):
            return f"{os.path.relpath(path, SRC)}:{line}"
    return "?"


class _StubLoops:
    """Stands in for the compiled C library of :mod:`lioncub.fused`: every loop a no-op (it writes
    only into buffers torch allocated); ``lc_encode`` returns 0 (every gradient finite)."""

    def __getattr__(self, name):
        if not name.startswith("lc_"):
            raise AttributeError(name)
        return lambda *args: 0


@contextlib.contextmanager
def stub_fused_loops():
    """:mod:`lioncub.fused`'s C loops replaced by no-ops for the block (fake tensors have no data).
    Patches the module's ``_build`` and ``_traced`` (which refuses the loops for fake tensors) and restores
    them (no file is changed)."""
    import warnings

    from lioncub import fused

    saved, traced = fused._build, getattr(fused, "_traced", None)  # (older trees: no _traced)
    fused._build = lambda: (_StubLoops(), "in use: no-op stand-ins (fake tensors)")
    if traced is not None:
        fused._traced = lambda t: False  # the library refuses the loops for fake tensors; the stand-ins take them
    try:
        with warnings.catch_warnings():  # the loops' argument lists read each fake tensor's (null) pointer
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")
            yield
    finally:
        fused._build = saved
        if traced is not None:
            fused._traced = traced


def allocation_site() -> str:
    """``file:line`` of the innermost frame of the library (src/lioncub) or of ``torch/optim``, else
    ``'?'``: who allocated, for the ``kept_at`` and ``transient_at`` breakdowns."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(LIBRARY):
            return f"{os.path.relpath(path, SRC)}:{frame.f_lineno}"
        if f"torch{os.sep}optim{os.sep}" in path:
            return f"torch/optim/{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _trackers():
    """The phase-recording subclasses of MemTracker and FSDPMemTracker (imported late: slow)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class Open:
        """A phase while it runs: its total before, its peak, and per site the live bytes it allocated."""

        def __init__(self, before: int, sites: bool):
            self.before = self.peak = before
            self.sites, self.mine, self.at_peak = sites, {}, {}

    class Phases:
        """Per phase (:meth:`phase`, nested as the code runs): ``phases[name] = (before, peak, after)`` total
        bytes. Every storage the tracker first sees inside a phase opened with ``sites=True`` is labelled
        with its :func:`allocation_site`: ``alive`` holds the live bytes of those per site, and
        ``at_peak[name]`` the phase's own per site at the phase's peak."""

        def _init_phases(self):
            self.phases: dict[str, tuple[int, int, int]] = {}
            self.alive: dict[str, int] = {}
            self.at_peak: dict[str, dict[str, int]] = {}
            self._open: list = []

        def total(self) -> int:
            return sum(snap["Total"] for snap in self._curr_mem_snap.values())

        def _track(self, reftype, t) -> None:  # MemTracker calls this for every op's outputs
            labelling = [p for p in self._open if p.sites]
            if not labelling:
                return super()._track(reftype, t)
            new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
            super()._track(reftype, t)
            for st in new:
                winfo = self._WINFO.get(st, (None, None))[0]
                if winfo is not None and winfo.mem_consumed:
                    winfo.site, winfo.phases = allocation_site(), labelling
                    self.alive[winfo.site] = self.alive.get(winfo.site, 0) + winfo.mem_consumed
                    for p in labelling:
                        p.mine[winfo.site] = p.mine.get(winfo.site, 0) + winfo.mem_consumed

        def _delete_callback(self, winfo, w_st) -> None:
            super()._delete_callback(winfo, w_st)
            site = getattr(winfo, "site", None)
            if site is not None:
                self.alive[site] -= winfo.mem_consumed
                for p in winfo.phases:
                    p.mine[site] -= winfo.mem_consumed

        def _update_peak_stats(self, peak_state) -> None:  # MemTracker calls this after every op
            # the global peak only: MemTracker's per-module peaks (unused here) loop over every module
            # at every op, which is quadratic in the layers (half an hour for the 70B rows)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)
            if self._open:
                total = self.total()
                for p in self._open:
                    if total > p.peak:
                        p.peak = total
                        if p.sites:
                            p.at_peak = {k: v for k, v in p.mine.items() if v}

        @contextlib.contextmanager
        def phase(self, name: str, sites: bool = False):
            p = Open(self.total(), sites)
            self._open.append(p)
            try:
                yield
            finally:
                self._open.remove(p)
                after = self.total()
                self.phases[name] = (p.before, max(p.peak, after), after)
                self.at_peak[name] = p.at_peak

        def overall_peak(self) -> int:
            return sum(self._peak_mem.values())

    class PhaseTracker(Phases, MemTracker):
        def __init__(self):
            super().__init__()
            self._init_phases()

    class FSDPPhaseTracker(Phases, FSDPMemTracker):
        def __init__(self, module):
            super().__init__(module)
            self._init_phases()

    return PhaseTracker, FSDPPhaseTracker


def clear_library_caches() -> None:
    """Empty the library's ``lru_cache`` tables (:mod:`lioncub.wire.kernels` keeps lookup tables per
    device): a fake tensor left there would reach a later real run, or another fake mode, in this
    process. The fused loops' build (``lioncub.fused._build``) is kept."""
    for name, module in list(sys.modules.items()):
        if name == "lioncub" or name.startswith("lioncub."):
            for value in list(vars(module).values()):
                if hasattr(value, "cache_clear") and getattr(value, "__module__", None) == name and not (
                        name == "lioncub.fused" and value.__name__ == "_build"):
                    value.cache_clear()


@contextlib.contextmanager
def fake_world(world: int):
    """This process as rank 0 of a fake process group of ``world`` ranks for the block (destroyed after
    it, with the meshes and groups made on it). Refuses to replace a process group already running."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("bench/memory.py plays a fake world: run it where no process group is initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a DTensor's: its local tensor's)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = _local(t).untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total


def host_tensors(opt) -> list[torch.Tensor]:
    """The tensors ``opt`` keeps in host memory: LocalCub's outer state with ``outer_state='host'`` (every tensor of
    its ``state``, and the owner residuals); none otherwise. Under the fake mode they are ``cpu`` tensors like the
    device's, so ``bench/memory.py`` counts them apart."""
    if getattr(opt, "outer_state", "device") != "host":
        return []
    return [v for entry in opt.state.values() for v in entry.values() if isinstance(v, torch.Tensor)] \
        + list(opt.owner_residuals.values())


def storage_ids(tensors) -> set:
    """The distinct storages under ``tensors`` (a DTensor's: its local tensor's), as :func:`storage_bytes` tells
    them apart."""
    return {_local(t).untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def state_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of ``opt.state`` and of the optimizers it drives (LocalCub's ``inner``, NodeCub's
    ``voter``)."""
    out = []
    for o in (opt, getattr(opt, "inner", None), getattr(opt, "voter", None)):
        if isinstance(o, torch.optim.Optimizer):
            for entry in o.state.values():
                out.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    return out
