"""Moved to :mod:`lioncub.engine.auto`; this path stays for one release (the same module object)."""
import sys as _sys

from .engine import auto as _moved

_sys.modules[__name__] = _moved
