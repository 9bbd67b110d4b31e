"""What the Triton kernel tests share: the interpreter set up before the kernels are defined, the kernels' module
(``tk``), the cases decorator that works with and without pytest, and the exact comparisons.

The kernel tests (``tests/test_triton_encode.py``: the message side — encode, quantized lanes, the vote count;
``tests/test_triton_apply.py``: the update side; ``tests/test_triton.py``: the route to them — launches, the
switch, gpu-check) equal the torch CPU path bit for bit. By default on CPU tensors, run by Triton's interpreter
(``TRITON_INTERPRET=1``; small tensors: the interpreter is slow). With ``LIONCUB_TEST_DEVICE=cuda`` (what
``make gpu-check`` does) the same tests run the compiled kernels on CUDA copies of the inputs against the same CPU
references: the GPU must give the CPU path's bits.

Without pytest (a bare GPU machine) ``tests/gpu/kernel_runner.py`` runs those files' tests itself: each ``test_*``
whose arguments are only its :func:`cases` (the parametrised ones, and those with none); the ones that need
pytest's fixtures (``tmp_path``, ``capsys``) are skipped there and listed. Patching uses the standard library's
``unittest.mock``, not pytest's ``monkeypatch``, so the same functions run either way."""
import contextlib
import importlib
import os
import sys
from pathlib import Path
from unittest import mock

DEVICE = os.environ.get("LIONCUB_TEST_DEVICE", "cpu")
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (at the module's import)

try:
    import pytest  # noqa: E402
except ImportError:  # tests/gpu/kernel_runner.py on a machine without pytest
    pytest = None
import torch  # noqa: E402

if pytest is not None:
    from tests.conftest import require_module  # noqa: E402

    triton = require_module("triton")  # a skip; a failure under LIONCUB_REQUIRE=triton (.ci/run)
else:
    triton = importlib.import_module("triton")  # the runner's machine must have it

from lioncub.lion import apply_update_, interpolate  # noqa: E402
from tests.kernel_data import kernel_tensors  # noqa: E402  (m, g with zeros and -0.0 of c: ties)

if "lioncub.fused.triton" in sys.modules:  # defined earlier without the interpreter: define again
    tk = importlib.reload(sys.modules["lioncub.fused.triton"])
else:
    from lioncub.fused import triton as tk  # noqa: E402
if DEVICE == "cpu" and _INTERPRET_BEFORE is None:  # later test files see the environment as it was;
    del os.environ["TRITON_INTERPRET"]  # the fixture below sets it again around each test here
if DEVICE != "cpu" and not tk.available():  # asked for the GPU: never skip silently
    raise RuntimeError(f"LIONCUB_TEST_DEVICE={DEVICE} but the Triton kernels are {tk.status()}")

ROOT = Path(__file__).resolve().parents[1]
# odd sizes; bytes shared by two tensors at every lane width; an empty tensor; > one program (1024)
SIZES = [[1], [3, 21, 0, 5, 17], [1001, 2, 1030]]
HYPER = [(1e-3, 0.0, 0.99, False), (0.7, 1.3, 0.5, True)]  # (lr, weight decay, β2, maximize)


def cases(name: str, values: list):
    """``pytest.mark.parametrize(name, values)`` where pytest runs, and the same cases recorded on the function for
    tests/gpu/kernel_runner.py where it does not."""
    def mark(fn):
        fn.cases = (name, list(values))
        return pytest.mark.parametrize(name, values)(fn) if pytest is not None else fn
    return mark


class SkipCase(Exception):
    """A case that does not apply here (tests/gpu/kernel_runner.py's skip; pytest's where pytest runs)."""


def skip(reason: str):
    if pytest is not None:
        pytest.skip(reason)
    raise SkipCase(reason)


if pytest is not None:
    @pytest.fixture(autouse=True)
    def interpreter(monkeypatch):
        """Triton's interpreter also reads TRITON_INTERPRET when a kernel runs (each kernel test file takes this
        fixture in as ``_interpreter``)."""
        if DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
else:
    interpreter = None


def _d(x):
    """The kernels' copy of a tensor (or list) on DEVICE; the references stay on CPU."""
    return [t.to(DEVICE) for t in x] if isinstance(x, (list, tuple)) else x.to(DEVICE)


def _same(got, want) -> bool:
    """Bit for bit (fp32 compared as int32: -0.0 and NaN payloads too)."""
    got = [got] if isinstance(got, torch.Tensor) else got
    want = [want] if isinstance(want, torch.Tensor) else want
    return len(got) == len(want) and all(
        a.dtype == b.dtype and torch.equal(a.cpu().view(torch.int32) if a.dtype == torch.float32 else a.cpu(),
                                           b.view(torch.int32) if b.dtype == torch.float32 else b)
        for a, b in zip(got, want))


def _flag(finite, out) -> bool:
    """The kernels' finite report: a 0-dim bool tensor on ``out``'s device (never read back by
    the kernels); here read as a bool."""
    assert isinstance(finite, torch.Tensor) and finite.dim() == 0 and finite.dtype == torch.bool, finite
    assert finite.device == out.device, (finite.device, out.device)
    return bool(finite)


@contextlib.contextmanager
def _launches():
    """The kernels launched inside the block, in order (every launch goes through ``tk._launch``)."""
    counted, real = [], tk._launch
    with mock.patch.object(tk, "_launch", lambda kernel, *a, **kw: (counted.append(kernel), real(kernel, *a, **kw))):
        yield counted


def _flat_c(ms, gs, beta1, maximize):
    """The torch path's ``c = β1·m + (1-β1)·g`` of the tensors, concatenated (the stream)."""
    return torch.cat([x.reshape(-1) for x in interpolate(ms, gs, beta1, maximize=maximize)] + [torch.zeros(0)])


def _apply_case(sizes, seed):
    ms, gs = kernel_tensors(sizes, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ps = [torch.randn(n, generator=g) for n in sizes]
    return ps, ms, gs


def _reference(ps, ms, gs, u, lr, wd, beta2, maximize):
    """The torch path's update of copies of ``ps`` and ``ms`` from the votes ``u`` (the stream): ``ps + ms``."""
    ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
    apply_update_(ps_ref, list(u.float().split([p.numel() for p in ps])), ms_ref, gs, lr=lr, beta2=beta2,
                  weight_decay=wd, maximize=maximize, foreach=True)
    return ps_ref + ms_ref
