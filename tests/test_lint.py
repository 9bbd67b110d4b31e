"""Names that would fail only when their line runs: pyflakes over the package, the benchmarks and
the tests, for undefined names and imports that are never used. A race worker once died with
NameError after a file split, and no default-suite test ran that worker; this check sees it."""
from pathlib import Path

from tests.conftest import require_module

pyflakes_api = require_module("pyflakes.api")
messages = require_module("pyflakes.messages")
reporter = require_module("pyflakes.reporter")

ROOT = Path(__file__).resolve().parents[1]
CHECKED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport, messages.UnusedImport)


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found: list[str] = []

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        if isinstance(message, CHECKED):
            self.found.append(str(message))


def _lint(paths) -> list[str]:
    out = _Collect()
    for path in paths:
        pyflakes_api.checkPath(str(path), out)
    return out.found


def _python_files():
    for top in ("src/lioncub", "bench", "tests", "examples"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_undefined_names_or_unused_imports():
    found = _lint(_python_files())
    assert not found, "\n".join(found)


def test_the_check_sees_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef worker():\n    return helper()\n")
    found = _lint([bad])
    assert any("undefined name 'helper'" in f for f in found) and any("'os' imported but unused" in f for f in found)
