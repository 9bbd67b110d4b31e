"""What the suite may skip for, and the switch that turns those skips into failures.

Each thing a test can skip for has a name (``REQUIREMENTS``: name -> probe). Without the switch
a test that lacks it is skipped, as before. With ``LIONCUB_REQUIRE=name,name,...`` (``.ci/run``
sets it to what CI's machine is set up to run) a missing named requirement is a failure instead,
so a lost dependency, a lost compiler or a run without root cannot turn CI green by skipping:

* ``require(name)`` / ``require(name, available, why)`` inside a test (or at module level),
* ``require_module(modname)`` in place of ``pytest.importorskip`` (returns the module),
* the marks ``@pytest.mark.requires(name, ...)`` and ``@pytest.mark.root`` (= ``requires("root")``),
* and at session start every name in ``LIONCUB_REQUIRE`` is probed once: a missing one stops
  the run (exit code 4), which also covers skip sites that test the same thing their own way
  (``fused.available()`` in tests/test_fused.py, test_distributed.py, test_triton.py: ``compiler``).

An unknown name in ``LIONCUB_REQUIRE`` is a usage error (a typo must not require nothing).
Skips for what CI does not have (a CUDA GPU) have no name here and stay skips.

Set-up shared by the whole run (issue 36, item 6): at session start ``LIONCUB_CACHE`` points at one
directory under pytest's base temp (unless the caller set it), so this process and every worker,
torchrun job and script a test starts (they inherit the environment) find the same built C loops and
prepared corpus instead of compiling or tokenising their own, and the suite never reads or writes
``~/.cache/lioncub``. The session fixtures ``fused_loops`` (built once), ``corpus_cache`` (that
directory, Shakespeare prepared in it once: ``--cache-dir`` / ``cache_dir`` for ``data='shakespeare'``)
and ``prepared_corpus`` (its ``shakespeare-bytes`` token directory) name them; the corpus is
read-only, a test that writes next to it keeps its own directory.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

import pytest

ENV = "LIONCUB_REQUIRE"


def _module(modname: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        return None if importlib.util.find_spec(modname) is not None else f"{modname} is not installed"
    return probe


def _root() -> str | None:
    from lioncub.testbed import netem  # the testbed's own check (root, `ip`, `tc`)
    return netem.check_available()


def _compiler() -> str | None:
    from lioncub import fused  # builds the C loops on first use (cached), as the tests do
    if fused.available():
        return None
    cc = os.environ.get("CC", "cc")
    return f"the fused C loops are not built ({fused.status()}; {cc!r} on PATH: {shutil.which(cc) is not None})"


# name -> probe: None when available, else why not. The names are what LIONCUB_REQUIRE takes.
REQUIREMENTS: dict[str, Callable[[], str | None]] = {
    "triton": _module("triton"),              # tests/test_triton.py (Triton's CPU interpreter, the sm_90 compile)
    "root": _root,                            # live network-namespace testbed (tests/test_testbed.py, mark `root`)
    "compiler": _compiler,                    # the fused C loops (tests/test_fused.py, test_distributed.py, test_triton.py)
    "lion_pytorch": _module("lion_pytorch"),  # tests/test_lion.py reference optimizer
    "tqdm": _module("tqdm"),                  # tests/test_tools.py progress bar
    "tensorboard": _module("tensorboard"),    # tests/test_tools.py event files
    "transformers": _module("transformers"),  # HF Trainer: tests/test_examples.py, tests/test_ddp_hook.py
    "accelerate": _module("accelerate"),      # HF Trainer: tests/test_examples.py
    "lightning": _module("lightning"),        # tests/test_examples.py Lightning example
    "torchft": _module("torchft"),            # tests/test_ft.py fault-tolerant rounds (lioncub[ft])
    "pyflakes": _module("pyflakes"),          # tests/test_lint.py undefined names, unused imports
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def required() -> set[str]:
    """The names in LIONCUB_REQUIRE (comma- or space-separated); unknown names raise UsageError."""
    names = {_norm(n) for n in os.environ.get(ENV, "").replace(",", " ").split()}
    unknown = sorted(names - REQUIREMENTS.keys())
    if unknown:
        raise pytest.UsageError(f"{ENV} names unknown requirement(s) {', '.join(unknown)}; "
                                f"known: {', '.join(REQUIREMENTS)}")
    return names


def require(name: str, available: bool | None = None, why: str | None = None) -> None:
    """Return when requirement ``name`` is met; else fail when ``name`` is in LIONCUB_REQUIRE,
    skip otherwise. ``available=None`` asks the requirement's probe (and its reason)."""
    __tracebackhide__ = True  # skip/fail reports point at the test's line, not here
    name = _norm(name)
    if name not in REQUIREMENTS:
        raise ValueError(f"unknown requirement {name!r}; known: {', '.join(REQUIREMENTS)}")
    if available is None:
        reason = REQUIREMENTS[name]()
        available, why = reason is None, why or reason
    if available:
        return
    why = why or f"{name} is not available"
    if name in required():
        pytest.fail(f"{ENV} includes {name!r} but {why}", pytrace=False)
    pytest.skip(f"{why} (set {ENV}={name} to fail instead)", allow_module_level=True)


def require_module(modname: str, name: str | None = None, why: str | None = None):
    """``pytest.importorskip`` under requirement ``name`` (default: the module's top-level name).
    Only a missing module is skipped/failed; a module that is there but breaks on import raises."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        missing = f"could not import {modname!r}: {exc}"
    require(name or modname.split(".")[0], False, why or missing)  # (outside `except`: no chained traceback)


def pytest_configure(config):
    required()  # an unknown name stops the run here


CACHE_ENV = "LIONCUB_CACHE"  # lioncub.fused's build cache and the harness's default --cache-dir
_OWN_CACHE: list[str] = []  # the directory this run made and set CACHE_ENV to (empty: the caller's own)


def _session_cache(config) -> Path:
    """The run's LIONCUB_CACHE: the caller's, else ``<basetemp>/lioncub-cache``, set in os.environ
    before collection (test modules build the C loops on import) so that children inherit it."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's tmp_path_factory (None under -p no:tmpdir)
    path = factory.getbasetemp() / "lioncub-cache" if factory is not None else Path(tempfile.mkdtemp(prefix="lioncub-cache-"))
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    _OWN_CACHE.append(str(path))
    return path


def pytest_unconfigure(config):
    if _OWN_CACHE and os.environ.get(CACHE_ENV) == _OWN_CACHE[0]:
        del os.environ[CACHE_ENV]


@pytest.fixture(scope="session")
def fused_loops() -> str:
    """The fused C loops built once for the run, in its LIONCUB_CACHE (workers load that .so):
    ``fused.status()``. Request it before starting processes that use them, so that they load
    instead of each compiling at once."""
    from lioncub import fused
    fused.available()
    return fused.status()


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.iterdir())}


@pytest.fixture(scope="session")
def corpus_cache(fused_loops) -> Path:
    """The run's cache directory with Shakespeare prepared in it once (``shakespeare-bytes/``, as
    ``lioncub prepare`` / ``ensure_prepared`` write it): pass as ``--cache-dir`` (or ``cache_dir``)
    with the default ``--data shakespeare``. It is LIONCUB_CACHE, the harness's default cache, so
    runs without ``--cache-dir`` share it too, and holds the built C loops (``fused_loops``: the
    training workers that read the corpus load them, not each compile at once)."""
    # Read-only: the run fails at its end if a test wrote into the token directory (a test that
    # prepares another corpus keeps its own cache).
    from lioncub.harness.data import ensure_prepared

    cache = Path(os.environ.get(CACHE_ENV) or _session_cache(None))
    tok = Path(ensure_prepared("shakespeare", str(cache)))
    own = str(cache) in _OWN_CACHE  # never chmod a cache the caller chose
    if own:
        for f in tok.iterdir():
            f.chmod(0o444)
        tok.chmod(0o555)  # (root ignores modes: the listing check below still catches a write)
    before = _listing(tok)
    yield cache
    after = _listing(tok)
    if own:
        tok.chmod(0o755)
        for f in tok.iterdir():
            f.chmod(f.stat().st_mode | stat.S_IWUSR)
    assert after == before, f"a test wrote into the shared prepared corpus {tok}: {sorted(set(after.items()) ^ set(before.items()))}"


@pytest.fixture(scope="session")
def prepared_corpus(corpus_cache) -> Path:
    """The shared, read-only Shakespeare token directory (train.bin, val.bin, meta.json)."""
    return corpus_cache / "shakespeare-bytes"


def pytest_sessionstart(session):
    _session_cache(session.config)  # before the probes below and collection: both may build the C loops
    missing = [f"{n}: {why}" for n in sorted(required()) if (why := REQUIREMENTS[n]()) is not None]
    if missing:
        raise pytest.UsageError(f"{ENV} requires what this machine lacks: " + "; ".join(missing))


def _marked(item) -> list[str]:
    """The requirements a test's marks name: ``root``, and ``requires(name, ...)``."""
    names = ["root"] if item.get_closest_marker("root") is not None else []
    return names + [_norm(n) for mark in item.iter_markers("requires") for n in mark.args]


def imported_tests(items) -> list[str]:
    """Collected test functions that a test module imported rather than defined (a library function
    whose name starts with ``test`` becomes a "test" that checks nothing of its own)."""
    return [item.nodeid for item in items if isinstance(item, pytest.Function) and item.module is not None
            and getattr(item.function, "__module__", item.module.__name__) != item.module.__name__]


def pytest_collection_modifyitems(items):
    """A marked test that lacks a requirement not named in LIONCUB_REQUIRE gets a skip mark (its
    own location in the report); each requirement probed once. A test function a module imported
    stops the run (``imported_tests``)."""
    imported = imported_tests(items)
    if imported:
        raise pytest.UsageError(f"collected functions imported into a test module, not defined there: {imported}; "
                                "import them under a name that does not start with 'test'")
    wanted, why = required(), {}
    for item in items:
        for name in _marked(item):
            if name not in REQUIREMENTS:
                raise pytest.UsageError(f"{item.nodeid}: unknown requirement {name!r}; known: {', '.join(REQUIREMENTS)}")
            if name not in why:
                why[name] = REQUIREMENTS[name]()
            if why[name] is not None and name not in wanted:
                item.add_marker(pytest.mark.skip(reason=f"{why[name]} (set {ENV}={name} to fail instead)"))


def pytest_runtest_setup(item):
    for name in _marked(item):
        if name in required():  # (the session-start probe has already stopped a run that lacks one)
            require(name)
