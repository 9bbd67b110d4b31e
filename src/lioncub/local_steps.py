"""Moved to :mod:`lioncub.optim.localcub`; this path stays for one release (the same module object)."""
import sys as _sys

from .optim import localcub as _moved

_sys.modules[__name__] = _moved
