"""Moved to :mod:`lioncub.wire.packing`; this path stays for one release (the same module object)."""
import sys as _sys

from .wire import packing as _moved

_sys.modules[__name__] = _moved
