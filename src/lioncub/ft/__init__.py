"""Fault-tolerant LocalCub on torchft (an optional extra: ``pip install 'lioncub[ft]'``).

:class:`FTLocalCub` runs LocalCub's rounds through a torchft ``Manager``: a round that loses a
replica is not committed and is retried by the survivors, and a replica that (re)joins heals
from a live peer (docs/fault_tolerance.md). :func:`make_manager` and :func:`start_lighthouse`
build what it needs for a replica group of one worker or of many ranks (its own torch.distributed world,
FSDP2 shards inside), every server on the address given
(loopback by default).
"""
from __future__ import annotations

from datetime import timedelta

from .. import comm
from ..optim.replicas import (FTLionCub, FTLocalCub, QuorumError, QuorumRanks, ReplicaGroup, TensorTransport,
                              require_torchft)

__all__ = ["FTLocalCub", "FTLionCub", "ReplicaGroup", "QuorumRanks", "TensorTransport", "QuorumError", "require_torchft",
           "make_manager", "process_group_name", "start_lighthouse"]


def start_lighthouse(min_replicas: int, *, host: str = "127.0.0.1", port: int = 0, join_timeout_ms: int = 1000,
                     heartbeat_timeout_ms: int = 1000, quorum_tick_ms: int = 50):
    """A torchft lighthouse bound to ``host:port`` (port 0: any free one); ``.address()`` is
    what replicas pass as ``lighthouse=`` (or set as ``TORCHFT_LIGHTHOUSE``). A replica silent
    for ``heartbeat_timeout_ms`` leaves the next quorum."""
    require_torchft()
    from torchft._torchft import LighthouseServer
    return LighthouseServer(bind=f"{host}:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def process_group_name(device) -> str:
    """The name of torchft's process group for parameters on ``device`` (in ``torchft.process_group``):
    ``ProcessGroupNCCL`` for CUDA (NCCL sends CUDA tensors only), ``ProcessGroupGloo`` elsewhere."""
    import torch

    return "ProcessGroupNCCL" if torch.device(device).type == "cuda" else "ProcessGroupGloo"


def make_manager(replica_id: str, lighthouse: str, *, min_replicas: int = 2, host: str = "127.0.0.1",
                 timeout_s: float = 10.0, quorum_timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 device="cpu"):
    """A torchft ``Manager`` for this rank of its replica group, every server on ``host``.

    The replica group is this process's torch.distributed world when one is initialised (each replica group its
    own world, e.g. the FSDP2 mesh over a node's ranks: call this on every rank of it, with the same
    ``replica_id``), else one worker. Its group rank 0 holds the group's store and torchft's ManagerServer (the
    store's port goes to the other ranks by a broadcast in the group).

    ``timeout_s``: a collective's (and the healing transfer's) limit, the longest a death
    inside a collective can stall the survivors; ``quorum_timeout_s``: how long a replica
    waits for ``min_replicas`` live replicas before :class:`QuorumError`; ``device``: the parameters'
    device, which picks the process group (:func:`process_group_name`). Returns the manager;
    its TCP store (``manager.lioncub_store``) lives as long as it."""
    require_torchft()
    import torch.distributed as dist
    from torchft.manager import Manager

    from torchft import process_group

    pg = getattr(process_group, process_group_name(device))(timeout=timedelta(seconds=timeout_s))
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = store.port if ranks == 1 else comm.broadcast_object(store.port if rank == 0 else None, device=device)
    if rank == 0:
        _check_reachable(lighthouse, connect_timeout_s)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None,
        min_replica_size=min_replicas, use_async_quorum=False, replica_id=replica_id,
        lighthouse_addr=lighthouse, store_addr=host, store_port=port, rank=rank, world_size=ranks, hostname=host,
        timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=connect_timeout_s),
        checkpoint_transport=TensorTransport(host, timeout=timedelta(seconds=timeout_s)))
    manager.lioncub_store = store
    return manager


def _check_reachable(lighthouse: str, timeout_s: float) -> None:
    """A one-line ConnectionError when nothing listens at the lighthouse's address."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    try:
        with socket.create_connection((where.hostname, where.port or 29510), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(f"lighthouse: no torchft lighthouse reachable at {lighthouse} within {timeout_s:g} s "
                              f"({exc}); start one (torchft_lighthouse --min_replicas N) or set TORCHFT_LIGHTHOUSE")
