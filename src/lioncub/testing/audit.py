"""The device audit: every collective and every host sync of a run, recorded.

NCCL refuses a CPU tensor in a collective, supports only some dtypes and reduce ops,
and a host sync (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``) stalls the CPU
until the GPU has caught up. None of that shows on a CPU-only machine with gloo, which
takes CPU tensors happily and where a sync costs nothing. :class:`DeviceAudit` makes it
visible without a GPU: run the optimizer with its parameters on a non-CPU device inside
the audit, and it records, through one :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that sees every ATen and c10d operator:

* every collective (the ``c10d`` operators ``torch.distributed`` lowers to, whoever
  calls them): the device and dtype of each tensor, the reduce op. A tensor off the
  audited device, a dtype NCCL lacks, or a reduce op other than SUM/MAX/MIN is a
  *violation*;
* every host sync: a read of a device scalar (``aten._local_scalar_dense``: ``item``,
  ``bool``, ``int``), a copy from the device to the CPU (``.cpu()``, ``.tolist()``,
  ``.numpy()``; not a non_blocking ``copy_`` into pinned memory, which nobody waits for:
  LocalCub's host state, :meth:`DeviceAudit._into_pinned`), a blocking copy of a CPU tensor
  onto the device (``torch.tensor(list, device=cuda)``: torch waits for the stream after a
  pageable copy), and ops whose output
  size depends on the data (``nonzero``, ...), each
  under the current *phase* (:meth:`DeviceAudit.phase`: e.g. one optimizer step) and
  flagged when it happens inside backward (an autograd hook);
* every random draw the library makes on the device: it must use a generator on that device
  (made by :func:`lioncub.comm.make_generator`, saved in the optimizer's state), not torch's
  global one or a CPU one.

Why ``meta``: a ``meta`` tensor has a device, shapes and dtypes but no data, and torch
refuses to mix it with CPU tensors exactly as it refuses CUDA ones, so a CPU tensor that
reaches a device op fails there and one that reaches a collective is recorded. It needs no
GPU and no second process: with the fake process group
(``torch.testing._internal.distributed.fake_pg``) a collective on P "ranks" returns at once.

Blind spot: ``torch.tensor(data, device=d)`` fills its tensor without an operator the mode
sees; the library writes ``torch.tensor(data).to(d)`` (set-up only) so that the copy shows.

Data-dependent branches: a sync on ``meta`` has no value to read. The audit answers it with
zeros (``drive``: a function of the phase and the tensor may answer otherwise). The
library's agreements are written so that zero is the ordinary path (no rank lacks a
gradient, no rank saw a NaN, replicas equal), and the audit's callers drive the other
branches (a non-finite step) on purpose, so no branch goes unaudited because the fake value
never chose it. On a real device (``make gpu-check``) the same audit runs with real values.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["DeviceAudit", "Collective", "Sync", "NCCL_DTYPES", "NCCL_OPS"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../lioncub/
_NOT_LIBRARY = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("testing", "testbed"))

NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64)
"""Dtypes every NCCL collective accepts (NCCL has no bool, int16 or complex)."""

NCCL_OPS = {0: "SUM", 3: "MIN", 4: "MAX"}
"""Reduce ops (c10d's ``RedOpType`` values) allowed: NCCL has no BAND/BOR/BXOR, and AVG only
on floats from 2.10; the library uses SUM and MAX."""

_RANDOM = {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "uniform",
           "uniform_", "normal", "normal_", "bernoulli", "bernoulli_", "exponential_", "geometric_",
           "multinomial", "random_", "cauchy_", "log_normal_"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim",
                   "equal", "is_nonzero", "allclose", "repeat_interleave"}


def _non_blocking(name: str, args, kwargs) -> bool:
    """Whether a ``_to_copy`` / ``copy_`` was asked not to block (``copy_``'s flag may come positionally)."""
    return bool(kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))


@dataclass
class Collective:
    name: str
    phase: str
    tensors: list[tuple[str, str]]  # (device, dtype) per tensor argument
    op: Optional[str] = None


@dataclass
class Sync:
    name: str
    phase: str
    in_backward: bool
    where: str  # the library frame that asked for it


@dataclass
class DeviceAudit(TorchDispatchMode):
    """Record collectives, host syncs and random draws against ``device``.

    Use as a context manager; :meth:`phase` labels what runs inside it; ``violations`` are
    human-readable lines; :meth:`syncs_per_phase` counts syncs per phase label."""

    device: torch.device
    drive: Optional[Callable[[str, torch.Tensor], Optional[torch.Tensor]]] = None
    collectives: list[Collective] = field(default_factory=list)
    syncs: list[Sync] = field(default_factory=list)
    copies: list[Sync] = field(default_factory=list)
    """Non-blocking copies between the host and the device (``'to host'``, ``'from host'``): no host sync, but
    bytes over PCIe, recorded per phase (LocalCub's host state moves at a round's end only)."""
    violations: list[str] = field(default_factory=list)
    current: str = "setup"

    def __post_init__(self):
        super().__init__()
        self.device = torch.device(self.device)

    def __hash__(self):  # a mode is used as a key by the dispatcher's stack helpers
        return id(self)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    # ------------------------------------------------------------------ reports
    def syncs_per_phase(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.syncs:
            out[s.phase] = out.get(s.phase, 0) + 1
        return out

    def syncs_in_backward(self) -> list[Sync]:
        return [s for s in self.syncs if s.in_backward]

    def summary(self, step_prefix: str = "step") -> dict:
        """Counts for a report row: collectives, violations, the most syncs in one phase whose
        label starts with ``step_prefix``, syncs inside backward."""
        per = self.syncs_per_phase()
        steps = [n for k, n in per.items() if k.startswith(step_prefix)]
        return {"collectives": len(self.collectives), "violations": len(self.violations),
                "max_syncs_per_step": max(steps, default=0), "syncs_in_backward": len(self.syncs_in_backward())}

    # ------------------------------------------------------------------ the mode
    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self.device.type and (self.device.index is None or d.index == self.device.index)

    def _where(self) -> str:
        """The innermost frame of the library's own code (not its testing tools or launcher),
        or ``'?'`` when the caller's code asked."""
        for frame in reversed(traceback.extract_stack()[:-3]):
            path = os.path.abspath(frame.filename)
            if path.startswith(_PACKAGE) and not path.startswith(_NOT_LIBRARY):
                return f"{os.path.basename(path)}:{frame.lineno} {frame.name}"
        return "?"

    def _sync(self, name: str) -> None:
        in_bw = torch._C._current_graph_task_id() != -1
        self.syncs.append(Sync(name, self.current, in_bw, self._where()))

    def _copy(self, name: str) -> None:
        in_bw = torch._C._current_graph_task_id() != -1
        self.copies.append(Sync(name, self.current, in_bw, self._where()))

    def _answer(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        if self.drive is not None:
            value = self.drive(self.current, t)
            if value is not None:
                return value
        return torch.zeros(t.shape, dtype=t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d":
            self._collective(func, name, args, kwargs)
            return func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if name in ("_to_copy", "copy_") and self.device.type != "cpu" and self._from_cpu(name, args, kwargs):
            if _non_blocking(name, args, kwargs):
                self._copy("from host")
            else:
                self._sync("copy from cpu")  # a pageable host-to-device copy waits for the stream
        dev = [t for t in tensors if self._on_device(t)]
        if dev and self.device.type != "cpu":
            if name == "_local_scalar_dense":
                self._sync("item")
                if dev[0].device.type == "meta":
                    return self._answer(dev[0]).item()
            elif name in ("_to_copy", "copy_") and self._to_cpu(name, args, kwargs):
                if self._into_pinned(name, args, kwargs):
                    self._copy("to host")
                else:
                    self._sync("copy to cpu")
                if dev[0].device.type == "meta":
                    host = self._answer(dev[0]).to(kwargs.get("dtype") or dev[0].dtype)
                    if name == "copy_":
                        return args[0].copy_(host)
                    return host
            elif name in _DATA_DEPENDENT:
                self._sync(name)
                if dev[0].device.type == "meta":
                    self.violations.append(f"{self.current}: {name} on the device (data-dependent shape: a host sync) "
                                           f"at {self._where()}")
                    raise RuntimeError(f"device audit: {name} needs the data of a {dev[0].device} tensor")
        if name in _RANDOM:
            self._random(name, args, kwargs, tensors)
        return func(*args, **kwargs)

    def _from_cpu(self, name, args, kwargs) -> bool:
        """A copy of a CPU tensor onto the device (a 0-dim CPU tensor taken as an operand of a
        device op is passed as a scalar, with no copy: that is not counted). A blocking one is a
        sync; a non-blocking one is not: from pinned memory it does not wait; from pageable memory
        it may (the library's come from pinned memory, LocalCub's host state, or from the device)."""
        if name == "copy_":
            src, on = args[1], self._on_device(args[0])
        else:
            dst = kwargs.get("device")
            src, on = args[0], dst is not None and torch.device(dst).type == self.device.type
        return on and isinstance(src, torch.Tensor) and src.device.type == "cpu"

    def _into_pinned(self, name, args, kwargs) -> bool:
        """A non_blocking ``copy_`` into pinned host memory: the stream writes it when it gets there and nothing
        waits (the host must not read it before a sync: LocalCub waits at a checkpoint). On ``meta`` the flag is
        taken at its word: nothing is pinned without a GPU, and the library pins exactly when its parameters are
        on CUDA, where the audit of a real device (``make gpu-check``) sees the pinning itself."""
        if name != "copy_" or not _non_blocking(name, args, kwargs):
            return False
        return self.device.type == "meta" or args[0].is_pinned()

    def _to_cpu(self, name, args, kwargs) -> bool:
        if name == "copy_":
            return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and self._on_device(args[1])
        dst = kwargs.get("device")
        return dst is not None and torch.device(dst).type == "cpu" and self._on_device(args[0])

    def _random(self, name, args, kwargs, tensors) -> None:
        out_dev = kwargs.get("device")
        on_dev = any(self._on_device(t) for t in tensors) or (
            out_dev is not None and torch.device(out_dev).type == self.device.type)
        if not on_dev:
            return
        where = self._where()
        if where == "?":  # the caller's own draws (its data), not the library's
            return
        gen = kwargs.get("generator")
        if gen is None:
            self.violations.append(f"{self.current}: {name} on the device draws from torch's global RNG "
                                   f"(not saved with the optimizer) at {where}")
        elif self.device.type == "meta":  # no meta generators: the library's stand-in is the test
            from .. import comm
            _META_GENERATORS = getattr(comm, "_META_GENERATORS", ())
            # the dispatcher hands over a new Python wrapper of the same generator: compare states
            state = gen.get_state()
            if not any(torch.equal(state, g.get_state()) for g in list(_META_GENERATORS)):
                self.violations.append(f"{self.current}: {name} on the device uses a CPU generator not made by "
                                       f"lioncub.comm.make_generator at {where}")
        elif gen.device.type != self.device.type:
            self.violations.append(f"{self.current}: {name} on {self.device} with a {gen.device} generator "
                                   f"at {where}")

    def _collective(self, func, name, args, kwargs) -> None:
        flat = tree_flatten((args, kwargs))[0]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        op = None
        for a in flat:
            if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("ReduceOp"):
                code = int(a.op())
                op = NCCL_OPS.get(code, f"op {code}")
        rec = Collective(name, self.current, [(str(t.device), str(t.dtype).replace("torch.", "")) for t in tensors], op)
        self.collectives.append(rec)
        where = self._where()
        if name == "barrier":  # its tensor is made by the backend (device_ids under NCCL)
            if self.current.startswith("step"):
                self.violations.append(f"{self.current}: a barrier inside a step at {where}")
            return
        for t in tensors:
            if not self._on_device(t):
                self.violations.append(f"{self.current}: {name} got a {t.device} tensor ({t.dtype}), not "
                                       f"{self.device}, at {where}")
            elif t.dtype not in NCCL_DTYPES:
                self.violations.append(f"{self.current}: {name} got dtype {t.dtype}, which NCCL lacks, at {where}")
        if op is not None and op not in NCCL_OPS.values():
            self.violations.append(f"{self.current}: {name} with reduce {op}, which NCCL lacks, at {where}")
