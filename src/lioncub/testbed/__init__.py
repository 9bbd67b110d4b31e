"""Test and benchmark infrastructure, kept out of the optimizer's core package.

- :mod:`lioncub.testbed.netem`: an emulated slow cluster on one Linux host (network
  namespaces, veth pairs, ``tc tbf``), docs/design.md §8. Needs root, ``ip`` and ``tc``.
- :mod:`lioncub.testbed.launch`: the one local launcher (``spawn``): a free loopback port,
  ``nproc`` spawned workers in a process group, every rank's result or the failing rank's
  traceback. The tests, the harness and the benchmarks all start their workers through it.
- :mod:`lioncub.testbed.straggler`: a slower worker (``--slow-worker``, ``--pause-worker``): the sleep each
  step owes, called by the harness's loop (docs/stragglers.md).

Nothing in the optimizer imports this package; the harness (``--link``), the CLI's
``env`` report, the benchmarks and the tests do.
"""
from .launch import WorkerError, free_port, spawn
from .netem import TESTBED_SWITCH, Testbed, check_available, iface_bytes, parse_rate, setup_commands, testbed_unavailable

__all__ = ["Testbed", "check_available", "parse_rate", "setup_commands", "iface_bytes",
           "spawn", "free_port", "WorkerError", "TESTBED_SWITCH", "testbed_unavailable"]
