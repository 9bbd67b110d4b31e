"""Moved to :mod:`lioncub.engine.overlap`; this path stays for one release (the same module object)."""
import sys as _sys

from .engine import overlap as _moved

_sys.modules[__name__] = _moved
