"""Moved to :mod:`lioncub.ddp.hook`; this path stays for one release (the same module object)."""
import sys as _sys

from .ddp import hook as _moved

_sys.modules[__name__] = _moved
