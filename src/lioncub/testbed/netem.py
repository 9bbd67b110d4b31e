"""An emulated cluster on one Linux host: one network namespace per node (docs/design.md §8).

Topology, all inside namespaces this module creates (needs root, ``ip`` and ``tc``)::

    <prefix>-<tag>-w0 [lo, veth0 10.77.1.1/24] ──veth── hub0 ┐
    <prefix>-<tag>-w1 [lo, veth1 10.77.1.2/24] ──veth── hub1 ├─ br0 in <prefix>-<tag>-hub
    ...                                                       ┘

Every veth carries ``tc tbf rate R burst 256kb latency 50ms`` on **both** ends, so
each worker has an R-bit/s upload and an R-bit/s download, like a full-duplex NIC
on a non-blocking switch: the link the ring model of :mod:`lioncub.engine.cost` assumes.
``rate=None`` leaves the links unshaped (the CPU-bound floor; report it beside
every shaped figure). The burst must exceed 64 KiB (GSO), else throughput drops.

By default every worker is a node of its own. ``nodes=N`` puts ``n_workers / N``
consecutive ranks in each node's namespace: they share the node's shaped link to the
others, and reach each other at the node's own address, which Linux delivers over the
namespace's loopback — unshaped, like NVLink or PCIe next to Ethernet.

Workers start through ``ip netns exec`` with ``MASTER_ADDR`` = rank 0's address,
``GLOO_SOCKET_IFNAME`` = the node's veth (the hostname resolves to 127.0.0.1 in
every namespace), torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/
``GROUP_RANK`` and ``OMP_NUM_THREADS=1``.
Teardown (on exit, exception, Ctrl-C, SIGTERM or interpreter exit) kills the
processes by PID — ``ip netns del`` does not — and deletes the namespaces by name.

Example (as root)::

    with Testbed(4, rate="1gbit") as tb:
        before = tb.wire_bytes()
        tb.run_workers([[sys.executable, "train.py"]] * 4)
        sent = [a["tx"] - b["tx"] for a, b in zip(tb.wire_bytes(), before)]
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

__all__ = ["Testbed", "check_available", "parse_rate", "setup_commands", "iface_bytes", "wait_all",
           "TESTBED_SWITCH", "testbed_unavailable"]

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_UNIT = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # tc's SI units
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,15}$")
_SUBNET_RE = re.compile(r"^(10|192\.168|172\.(1[6-9]|2\d|3[01]))(\.\d{1,3}){0,2}$")
_counter = itertools.count()


def parse_rate(rate) -> tuple[str | None, float | None]:
    """``rate`` as (tc string, bits per second): '1gbit', '0.5gbit', '500mbit', 2e9, or None."""
    if rate is None:
        return None, None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bit/s; got {rate!r}")
        return f"{int(rate)}bit", float(int(rate))
    m = _RATE_RE.match(rate.strip()) if isinstance(rate, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"rate must be None, bits/s > 0, or like '1gbit', '0.5gbit', '500mbit'; got {rate!r}")
    return rate.strip().lower(), float(m.group(1)) * _UNIT[m.group(2).lower()]


def check_available() -> str | None:
    """Why a testbed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return f"network namespaces and tc need root; running as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found on PATH"
    return None


def iface_bytes(ifname: str) -> dict:
    """Bytes sent/received so far on ``ifname`` in the caller's namespace (read from /sys).

    A worker inside the testbed reads its own veth (``os.environ['GLOO_SOCKET_IFNAME']``).
    """
    base = f"/sys/class/net/{ifname}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return {"tx": int(tx.read()), "rx": int(rx.read())}


def setup_commands(hub: str, workers: list[str], ips: list[str], *, rate: str | None,
                   burst: str = "256kb", latency: str = "50ms") -> list[list[str]]:
    """The ``ip``/``tc`` command lines that build the testbed, in order (pure)."""
    cmds = [["ip", "netns", "add", hub], ["ip", "-n", hub, "link", "set", "lo", "up"],
            ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", hub, "link", "set", "br0", "up"]]
    shape = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    for r, (ns, ip) in enumerate(zip(workers, ips)):
        dev, port = f"veth{r}", f"hub{r}"
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            # created inside the hub namespace: nothing touches the host's interfaces
            ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns],
            ["ip", "-n", hub, "link", "set", port, "master", "br0"],
            ["ip", "-n", hub, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev],
            ["ip", "-n", ns, "link", "set", dev, "up"],
        ]
        if rate is not None:  # worker upload, then worker download
            cmds += [["tc", "-n", ns, "qdisc", "add", "dev", dev] + shape,
                     ["tc", "-n", hub, "qdisc", "add", "dev", port] + shape]
    return cmds


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


class Testbed:
    """``nodes`` namespaces behind one bridge, each link shaped to ``rate`` both ways.

    Args:
        n_workers: workers (processes), 1..253.
        nodes: namespaces (default ``n_workers``: one worker each); must divide ``n_workers``;
            node ``k`` runs ranks ``k·L … k·L+L-1`` with ``L = n_workers / nodes``.
        rate: per-direction link rate, e.g. '1gbit' (default), '0.5gbit', '2gbit'; None = unshaped.
        prefix: namespace names are ``{prefix}-{tag}-hub`` and ``{prefix}-{tag}-w{node}``.
        burst, latency: tbf parameters (burst must exceed 64 KiB).
        subnet: first three octets of the private /24 used inside the namespaces.
        port: MASTER_PORT given to the workers.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, n_workers: int, rate="1gbit", *, prefix: str = "lcb", burst: str = "256kb",
                 latency: str = "50ms", subnet: str = "10.77.1", port: int = 29500, nodes: int | None = None):
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or not 1 <= n_workers <= 253:
            raise ValueError(f"n_workers must be an int in 1..253; got {n_workers!r}")
        nodes = n_workers if nodes is None else nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or n_workers % nodes:
            raise ValueError(f"nodes must be an int >= 1 that divides n_workers={n_workers}; got {nodes!r}")
        if not isinstance(prefix, str) or not _NAME_RE.match(prefix):
            raise ValueError(f"prefix must be a letter then up to 15 letters/digits/_; got {prefix!r}")
        if (not isinstance(subnet, str) or not _SUBNET_RE.match(subnet) or subnet.count(".") != 2
                or any(int(o) > 255 for o in subnet.split("."))):
            raise ValueError(f"subnet must be three octets of a private range, like '10.77.1'; got {subnet!r}")
        self.rate, self.rate_bps = parse_rate(rate)
        self.n_workers, self.prefix, self.port = n_workers, prefix, int(port)
        self.burst, self.latency = burst, latency
        base = f"{prefix}-{os.getpid():x}{next(_counter)}"
        self.hub = f"{base}-hub"
        self.nodes, self.local_size = nodes, n_workers // nodes
        self.namespaces = [f"{base}-w{k}" for k in range(nodes)]  # per node
        self.ips = [f"{subnet}.{k + 1}" for k in range(nodes)]
        self.ifnames = [f"veth{k}" for k in range(nodes)]
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ lifecycle
    def commands(self) -> list[list[str]]:
        return setup_commands(self.hub, self.namespaces, self.ips, rate=self.rate,
                              burst=self.burst, latency=self.latency)

    def __enter__(self) -> "Testbed":
        reason = check_available()
        if reason is not None:
            raise RuntimeError(f"cannot build the netem testbed: {reason}")
        existing = set(_run(["ip", "netns", "list"]).stdout.split())
        clash = [ns for ns in [self.hub] + self.namespaces if ns in existing]
        if clash:
            raise RuntimeError(f"namespace {clash[0]} already exists; delete it with `ip netns del {clash[0]}`")
        _register(self)
        try:
            for cmd in self.commands():
                _run(cmd)
                if cmd[1:3] == ["netns", "add"]:
                    self._created.append(cmd[3])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill our processes by PID, then delete our namespaces by name. Idempotent."""
        with self._lock:
            for p in self._procs:
                if p.poll() is None:  # a reaped PID may belong to someone else by now
                    _kill_group(p.pid)
            for ns in self._created:  # anything still inside (grandchildren) dies too
                for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                    _kill_group(int(pid), group=False)
            for p in self._procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for ns in reversed(self._created):
                _run(["ip", "netns", "del", ns], check=False)
            self._created.clear()
            _unregister(self)

    # ------------------------------------------------------------------ workers
    def env_for(self, rank: int, env: dict | None = None) -> dict:
        """The environment worker ``rank`` runs with: os.environ, then ``env``, then ours."""
        out = dict(os.environ)
        out.setdefault("OMP_NUM_THREADS", "1")
        out.update(env or {})
        node, local_rank = divmod(rank, self.local_size)
        out.update(MASTER_ADDR=self.ips[0], MASTER_PORT=str(self.port), RANK=str(rank),
                   WORLD_SIZE=str(self.n_workers), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(self.local_size), GROUP_RANK=str(node),
                   GLOO_SOCKET_IFNAME=self.ifnames[node])
        return out

    def launch(self, argv_per_rank, env: dict | None = None, *, stdout=None, stderr=None):
        """Start one process per worker namespace (non-blocking); returns the Popen objects."""
        argv_per_rank = [list(a) for a in argv_per_rank]
        if len(argv_per_rank) != self.n_workers or not all(argv_per_rank):
            raise ValueError(f"argv_per_rank must hold {self.n_workers} non-empty argument lists")
        if not self._created:
            raise RuntimeError("the testbed is not up; use `with Testbed(...) as tb:`")
        procs = []
        for r, argv in enumerate(argv_per_rank):
            p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[r // self.local_size]] + argv,
                                 env=self.env_for(r, env), start_new_session=True,
                                 stdout=stdout[r] if stdout else None, stderr=stderr[r] if stderr else None)
            with self._lock:
                self._procs.append(p)
            procs.append(p)
        return procs

    def run_workers(self, argv_per_rank, env: dict | None = None, *, timeout: float = 600.0,
                    check: bool = True) -> list[subprocess.CompletedProcess]:
        """Run one process per worker to completion; returns their exit codes and output.

        When one worker fails the others get 10 s, then are killed (they would wait
        for it forever). ``check``: raise RuntimeError with the failing worker's stderr.
        """
        with tempfile.TemporaryDirectory(prefix="lcb-netem-") as d:
            outs = [open(os.path.join(d, f"{r}.out"), "w+") for r in range(self.n_workers)]
            errs = [open(os.path.join(d, f"{r}.err"), "w+") for r in range(self.n_workers)]
            try:
                procs = self.launch(argv_per_rank, env, stdout=outs, stderr=errs)
                wait_all(procs, timeout)
                done = []
                for r, p in enumerate(procs):
                    outs[r].seek(0), errs[r].seek(0)
                    done.append(subprocess.CompletedProcess(p.args, p.returncode, outs[r].read(), errs[r].read()))
            finally:
                for f in outs + errs:
                    f.close()
        bad = [c for c in done if c.returncode != 0]
        if check and bad:
            r = done.index(bad[0])
            raise RuntimeError(f"worker {r} exited with {bad[0].returncode}:\n{bad[0].stderr[-4000:]}")
        return done

    def wire_bytes(self) -> list[dict]:
        """Per node, bytes its veth has sent (``tx``) and received (``rx``) so far, L2 frames
        (traffic between the ranks of one node never reaches the veth)."""
        out = []
        for ns, dev in zip(self.namespaces, self.ifnames):
            link = json.loads(_run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev]).stdout)[0]
            out.append({"tx": link["stats64"]["tx"]["bytes"], "rx": link["stats64"]["rx"]["bytes"]})
        return out


def _kill_group(pid: int, group: bool = True) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_all(procs, timeout: float) -> None:
    """Wait for every process; when one fails, give the others 10 s, then kill them (they would wait
    for it forever). Past ``timeout`` seconds: kills them all and raises TimeoutError."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            for p in procs:
                if p.poll() is None:
                    _kill_group(p.pid)
                    p.wait()
            if now > deadline:
                raise TimeoutError(f"testbed workers still running after {timeout:.0f} s; killed")
            return
        time.sleep(0.05)


# ---------------------------------------------------------------------- crash safety
_LIVE: list[Testbed] = []
_PREVIOUS: dict[int, object] = {}
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _cleanup_all() -> None:
    for tb in list(_LIVE):
        tb.close()


def _on_signal(signum, frame) -> None:
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)  # closing the last testbed clears it
    _cleanup_all()
    if callable(previous):
        previous(signum, frame)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(tb: Testbed) -> None:
    if not _LIVE and threading.current_thread() is threading.main_thread():
        for s in _SIGNALS:
            _PREVIOUS[s] = signal.signal(s, _on_signal)
    _LIVE.append(tb)


def _unregister(tb: Testbed) -> None:
    if tb in _LIVE:
        _LIVE.remove(tb)
    if not _LIVE and _PREVIOUS and threading.current_thread() is threading.main_thread():
        for s, h in _PREVIOUS.items():
            signal.signal(s, h)
        _PREVIOUS.clear()


atexit.register(_cleanup_all)


TESTBED_SWITCH = "LIONCUB_TESTBED"
"""The environment switch: ``LIONCUB_TESTBED=0`` keeps ``lioncub train``'s default comparison off the emulated link."""


def testbed_unavailable() -> str | None:
    """Why the default comparison cannot run behind an emulated link here, or None when it can:
    ``LIONCUB_TESTBED=0``, not root, no ``ip``/``tc``, or network namespaces that cannot be made
    (a probe builds and tears down a one-worker testbed)."""
    if os.environ.get(TESTBED_SWITCH, "").strip().lower() in ("0", "off", "no", "false"):
        return f"{TESTBED_SWITCH}={os.environ[TESTBED_SWITCH]} turns the emulated link off"
    reason = check_available()
    if reason is not None:
        return reason
    try:
        with Testbed(1, rate=None, prefix="lcprobe"):
            pass
    except RuntimeError as exc:
        return f"network namespaces cannot be made here ({exc})"
    return None
