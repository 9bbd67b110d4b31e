"""Test and benchmark infrastructure, kept out of the optimizer's core package.

- :mod:`lioncub.testbed.netem`: an emulated slow cluster on one Linux host (network
  namespaces, veth pairs, ``tc tbf``), docs/design.md §8. Needs root, ``ip`` and ``tc``.

Nothing in the optimizer imports this package; the harness (``--link``), the CLI's
``env`` report, the benchmarks and the tests do.
"""
from .netem import Testbed, check_available, iface_bytes, parse_rate, setup_commands

__all__ = ["Testbed", "check_available", "parse_rate", "setup_commands", "iface_bytes"]
