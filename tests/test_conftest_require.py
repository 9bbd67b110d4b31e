"""tests/conftest.py's switch: a missing requirement is a skip, and a failure when LIONCUB_REQUIRE names it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ENV, REQUIREMENTS, require, require_module, required

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_is_a_skip_without_the_switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="triton hidden here"):
        require("triton", False, "triton hidden here")
    monkeypatch.setenv(ENV, "root,compiler")  # other names required: still a skip
    with pytest.raises(pytest.skip.Exception, match=f"set {ENV}=triton to fail instead"):
        require("triton", False, "triton hidden here")


def test_missing_is_a_failure_under_the_switch(monkeypatch):
    for value in ("triton", "root, triton", " Triton ", "compiler triton"):
        monkeypatch.setenv(ENV, value)
        with pytest.raises(pytest.fail.Exception, match=f"{ENV} includes 'triton' but triton hidden here"):
            require("triton", False, "triton hidden here")


def test_present_passes_under_the_switch(monkeypatch):
    monkeypatch.setenv(ENV, ",".join(REQUIREMENTS))
    assert require("triton", True, "unused") is None
    monkeypatch.setitem(REQUIREMENTS, "tqdm", lambda: None)  # the probe answers when `available` is not given
    assert require("tqdm") is None
    monkeypatch.setitem(REQUIREMENTS, "tqdm", lambda: "tqdm probe says no")
    with pytest.raises(pytest.fail.Exception, match="tqdm probe says no"):
        require("tqdm")
    assert require_module("json").__name__ == "json"


def test_require_module_skips_or_fails_only_for_a_missing_module(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="could not import 'lioncub_no_such_module'"):
        require_module("lioncub_no_such_module", "lightning")
    monkeypatch.setenv(ENV, "lightning")
    with pytest.raises(pytest.fail.Exception, match=f"{ENV} includes 'lightning'"):
        require_module("lioncub_no_such_module", "lightning")
    (tmp_path / "lioncub_broken_module.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(ENV)
    with pytest.raises(ImportError, match="broken on purpose"):  # installed but broken: never a skip
        require_module("lioncub_broken_module", "lightning")


def test_unknown_names_are_refused(monkeypatch):
    monkeypatch.setenv(ENV, "triton,tritn")
    with pytest.raises(pytest.UsageError, match="unknown requirement.*tritn"):
        required()
    with pytest.raises(ValueError, match="unknown requirement 'cuda'"):
        require("cuda", False, "no GPU")


_CONFTEST = """
    from tests.conftest import (REQUIREMENTS, pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                                pytest_runtest_setup, pytest_sessionstart)
    REQUIREMENTS.update(fake_present=lambda: None, fake_missing=lambda: "fake_missing is hidden",
                        root=lambda: "no root here (faked)")
"""
_TESTS = """
    import pytest
    from tests.conftest import require

    @pytest.mark.requires("fake_missing")
    def test_marked():
        pass

    @pytest.mark.root
    def test_needs_root():
        pass

    def test_site():
        require("fake_present", False, "missing at the site")

    @pytest.mark.requires("fake_present")
    def test_present():
        require("fake_present")
"""


def _pytest(tmp_path, require_value: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = ROOT
    if require_value is not None:
        env[ENV] = require_value
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_session_with_the_switch(tmp_path):
    """The hooks end to end: markers and sites skip without the switch, fail with it; the
    session-start probe stops a run that requires what is missing; a typo is refused."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    root: r\n    requires(*names): r\n")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (tmp_path / "test_fake.py").write_text(textwrap.dedent(_TESTS))
    rc, out = _pytest(tmp_path, None)
    assert rc == 0 and re.search(r"\b1 passed, 3 skipped\b", out), out
    assert "fake_missing is hidden" in out and "no root here (faked)" in out and "missing at the site" in out
    rc, out = _pytest(tmp_path, "fake_present")
    assert rc == 1 and re.search(r"\b1 failed, 1 passed, 2 skipped\b", out), out
    assert f"{ENV} includes 'fake_present' but missing at the site" in out
    for value, why in (("fake_missing", "fake_missing: fake_missing is hidden"), ("root", "root: no root here")):
        rc, out = _pytest(tmp_path, value)
        assert rc == 4 and f"{ENV} requires what this machine lacks: {why}" in out, out
    rc, out = _pytest(tmp_path, "fake_present,nonsense")
    assert rc == 4 and "unknown requirement(s) nonsense" in out, out
