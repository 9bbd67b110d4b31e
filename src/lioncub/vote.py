"""Moved to :mod:`lioncub.votes.api`; this path stays for one release (the same module object)."""
import sys as _sys

from .votes import api as _moved

_sys.modules[__name__] = _moved
