"""Moved to :mod:`lioncub.engine.momentum`; this path stays for one release (the same module object)."""
import sys as _sys

from .engine import momentum as _moved

_sys.modules[__name__] = _moved
