"""Moved to :mod:`lioncub.fused.triton`; this path stays for one release (the same module object)."""
import sys as _sys

from .fused import triton as _moved

_sys.modules[__name__] = _moved
