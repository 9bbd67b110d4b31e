"""Parameters sharded by FSDP2 (DTensors): which ranks vote, and what each rank steps (docs/sharded.md).

FSDP2 (``torch.distributed.fsdp.fully_shard``) on the shard dimension of a 2-D mesh keeps each
parameter as a DTensor placed ``(Shard(0),)`` on the 1-D shard mesh: every rank holds a slice of
rows (its *local shard*), and after backward its local gradient is its shard group's mean. The
other dimension of the mesh is the replicas: ranks that hold the same slice of different
copies of the model, each on its own data. Lion Cub's vote belongs there, across replicas:

* every rank votes its local shard with the ranks that hold the same shard in the other replicas
  (the *replicas' group*: ``process_group=`` or inferred from the parameters' root mesh);
* Lion's momentum, the error-feedback residuals and every other per-parameter state are kept per
  local shard (saved as DTensors with the parameter's placement, so ``torch.distributed.checkpoint``
  stores each slice once and can load it on another mesh);
* the step's agreement (which parameters have a gradient, whether any is non-finite) spans every
  rank of the model, shard ranks included: a step skipped on one slice is skipped on all of them.

:class:`Sharding` holds that layout; the optimizer's engine sees only plain local tensors: the
parameters' local shards, their gradients' local shards (handed over at the start of each step)
and a view of the optimizer's state keyed by them (:class:`LocalState`).
"""
from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..validate import check_float_params

__all__ = ["Sharded", "Sharding", "LocalState", "sharding_of", "grads_on_shards", "check_sharded_options", "refuse_dtensors",
           "is_dtensor", "local_of"]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing can be sharded
        return None
    return DTensor


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter, its gradient or state)."""
    DTensor = _dtensor_type()
    return DTensor is not None and isinstance(t, DTensor)


def local_of(t: Tensor) -> Tensor:
    """This rank's local tensor of a DTensor (the same storage), else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def _placements(p) -> str:
    return "(" + ", ".join(repr(x) for x in p.placements) + ")"


HSDP_ADVICE = ("shard inside a node with fully_shard(module, mesh=mesh['shard']) (the shard dimension of the "
               "2-D mesh) and let LionCub vote across replicas (process_group=mesh.get_group('replicate'), or "
               "nothing: it is inferred from the mesh)")


class Sharding:
    """The layout of an optimizer's FSDP2 parameters (:func:`sharding_of` builds it and checks it).

    ``params``: the DTensor parameters in the optimizer's order; ``locals``: their local shards (FSDP2
    keeps these tensor objects for the module's life: the engine keys its work by them);
    ``mesh``: the 1-D shard mesh; ``replicas``: the replicas' process group (None when there is none:
    a 1-D mesh over the whole world, where the step is Lion on each shard); ``rank`` and ``size``:
    this rank in it and its size (0 and 1 without replicas)."""

    def __init__(self, params: Sequence[Tensor], mesh, replicas, rank: int, size: int, root=None):
        self.params, self.mesh, self.replicas, self.rank, self.size = list(params), mesh, replicas, rank, size
        self.root = root
        """The 2-D mesh of replicas x shards (None without replicas, or when the replicas' group given is
        not a dimension of the parameters' root mesh): where a checkpoint keeps every replica's state."""
        self.locals = [p._local_tensor for p in self.params]
        self._param_of = {id(x): p for x, p in zip(self.locals, self.params)}

    def param_of(self, local: Tensor) -> Tensor:
        """The DTensor parameter whose local shard is ``local``."""
        return self._param_of[id(local)]

    def wrap(self, local_param: Tensor, value: Tensor) -> Tensor:
        """``value`` (a tensor shaped as ``local_param``) as a DTensor placed like its parameter, sharing
        ``value``'s storage: how per-shard state is kept in the optimizer's ``state``."""
        from torch.distributed.tensor import DTensor

        p = self.param_of(local_param)
        return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)

    def stacked(self, local_param: Tensor, value: Tensor) -> Tensor:
        """Per-replica state (each replica's momentum is its own) as one DTensor of every replica's, shaped
        ``(replicas,) + parameter shape`` on the 2-D mesh: ``torch.distributed.checkpoint`` keeps one copy of
        what a DTensor says is replicated, so a shard's momenta must be distinct slices to be saved. Without
        replicas, the state as its parameter's DTensor (:meth:`wrap`)."""
        if self.size == 1:
            return self.wrap(local_param, value)
        if self.root is None:
            raise ValueError("state_dict: the replicas' group given is not a dimension of the parameters' mesh, so "
                             "a checkpoint cannot tell the replicas' momenta apart; build the mesh with "
                             "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')) and let LionCub infer it")
        from torch.distributed.tensor import DTensor, Shard

        p = self.param_of(local_param)
        shard_dim = self.root.mesh_dim_names.index(self.mesh.mesh_dim_names[0])
        placements = [Shard(1) if d == shard_dim else Shard(0) for d in range(2)]
        shape = (self.size,) + tuple(p.shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(value.unsqueeze(0), self.root, placements, shape=shape, stride=stride,
                                  run_check=False)

    def unstacked(self, local_param: Tensor, value):
        """This replica's state out of a saved value: :meth:`stacked`'s slice, or the value itself."""
        if is_dtensor(value) and value.ndim == local_param.ndim + 1:
            if value.shape[0] != self.size:
                raise ValueError(f"state_dict holds the state of {value.shape[0]} replicas, this run has {self.size}: "
                                 "each replica's momentum is its own, so a checkpoint resumes on as many replicas "
                                 "(the number of shards may change)")
            return local_of(value)[0]
        return value

    def spread(self, values: Tensor) -> Tensor:
        """This rank's per-tensor ``values`` in its shard's slot of a vector with one slot per shard (zeros
        elsewhere): summed over the whole world, each slot holds the sum over that shard's replicas (what a
        round's aggregation sums), in the one all-reduce whose flags the whole world agrees on."""
        out = values.new_zeros((self.mesh.size(), values.numel()))
        out[self.mesh.get_local_rank()] = values
        return out.reshape(-1)

    def slot(self, summed: list, n: int) -> list:
        """This rank's shard's ``n`` values out of :meth:`spread`'s vector, summed."""
        first = self.mesh.get_local_rank() * n
        return summed[first:first + n]

    def hand_grads(self) -> None:
        """Each local shard's ``.grad`` is its parameter's local gradient (None where it has none):
        at the start of every step (FSDP2 writes ``.grad`` of the DTensors)."""
        for x, p in zip(self.locals, self.params):
            g = p.grad
            x.grad = None if g is None else local_of(g)

    def drop_grads(self) -> None:
        """The local shards let go of the gradients (``zero_grad`` clears the DTensors' own)."""
        for x in self.locals:
            x.grad = None


class LocalState(MutableMapping):
    """The optimizer's ``state`` as the engine sees it: keyed by local shards (or by the DTensor
    parameters themselves), each entry a :class:`_LocalEntry` that reads DTensor values as their local
    tensors and stores new tensors as DTensors placed like the parameter (sharing storage)."""

    def __init__(self, state: dict, sharding: Sharding):
        self.state, self.sharding = state, sharding

    def _param(self, key: Tensor) -> Tensor:
        return self.sharding._param_of.get(id(key), key)

    def __getitem__(self, key):
        p = self._param(key)
        return _LocalEntry(self.state[p], local_of(p), self.sharding)

    def __setitem__(self, key, value):
        entry = self[key]
        entry.clear()
        entry.update(value)

    def __delitem__(self, key):
        del self.state[self._param(key)]

    def __contains__(self, key):
        return self._param(key) in self.state

    def __iter__(self):
        return iter(self.state)

    def __len__(self):
        return len(self.state)


class _LocalEntry(MutableMapping):
    """One parameter's state dict, through local tensors (see :class:`LocalState`)."""

    def __init__(self, entry: dict, local_param: Tensor, sharding: Sharding):
        self.entry, self.local_param, self.sharding = entry, local_param, sharding

    def __getitem__(self, key):
        return local_of(self.entry[key])

    def __setitem__(self, key, value):
        # (state kept on another device, LocalCub's host state, stays a plain tensor: DTensor.from_local would move
        # it onto the mesh's device)
        if torch.is_tensor(value) and not is_dtensor(value) and value.shape == self.local_param.shape \
                and value.device == self.local_param.device:
            value = self.sharding.wrap(self.local_param, value)
        self.entry[key] = value

    def __delitem__(self, key):
        del self.entry[key]

    def __iter__(self):
        return iter(self.entry)

    def __len__(self):
        return len(self.entry)


def _mesh_group_ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def sharding_of(params: Sequence[Tensor], process_group, who: str) -> Optional[Sharding]:
    """The :class:`Sharding` of ``params`` when they are FSDP2 DTensors, None when none is; a one-line
    ``ValueError`` for what cannot be voted exactly: a mix of DTensors and plain tensors, a native HSDP
    (2-D) placement, a placement other than FSDP2's ``Shard(0)`` on a 1-D mesh (tensor parallelism),
    parameters on different meshes, or a replicas' group that does not complete the shard mesh to the
    whole world. ``process_group``: the replicas' group as the user gave it (None: inferred)."""
    params = list(params)
    flags = [is_dtensor(p) for p in params]
    if not any(flags):
        return None
    if not all(flags):
        i, j = flags.index(False), flags.index(True)
        raise ValueError(f"params: {who} takes FSDP2 (DTensor) parameters or plain ones, not both: parameter {i} "
                         f"is a plain tensor, parameter {j} a DTensor; apply fully_shard to the root module too")
    from torch.distributed.tensor import Shard

    mesh = params[0].device_mesh
    for i, p in enumerate(params):
        if p.device_mesh.ndim != 1:
            raise ValueError(f"params: parameter {i} is placed {_placements(p)} on a {p.device_mesh.ndim}-D mesh "
                             f"(native HSDP, which all-reduces gradients across replicas itself); {HSDP_ADVICE}")
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"params: parameter {i} is placed {_placements(p)}; {who} takes FSDP2's Shard(dim=0) "
                             "shards only (tensor-parallel placements such as Shard(1), Replicate or Partial are "
                             "not supported)")
        if p.device_mesh != mesh:
            raise ValueError(f"params: parameter {i} lives on {p.device_mesh}, parameter 0 on {mesh}: one "
                             f"optimizer takes the parameters of one shard mesh")
    world = dist.get_world_size()
    me = dist.get_rank()
    shard_ranks = _mesh_group_ranks(mesh)
    if process_group is None:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if root is mesh or root.ndim == 1:
            replicas = None
        elif _other_dim(root, mesh) is not None:
            replicas = root.get_group(_other_dim(root, mesh))
        else:
            raise ValueError(f"process_group: the parameters' mesh is a slice of {root}; pass the replicas' group "
                             "(process_group=mesh.get_group('replicate'))")
    else:
        replicas = process_group
    if replicas is None:
        rank, size = 0, 1
        if len(shard_ranks) != world:
            raise ValueError(f"process_group: the shard mesh holds {len(shard_ranks)} of the world's {world} ranks "
                             "and no replicas' group was given or inferred; pass process_group= the group of the "
                             "ranks that hold this rank's shard in the other replicas")
        return Sharding(params, mesh, None, rank, size)
    replica_ranks = dist.get_process_group_ranks(replicas)
    shared = sorted(set(replica_ranks) & set(shard_ranks))
    if shared != [me]:
        raise ValueError(f"process_group: the replicas' group {replica_ranks} must hold exactly one rank of this "
                         f"rank's shard group {shard_ranks} (this rank, {me}); it is the other dimension of the mesh "
                         "(mesh.get_group('replicate'))")
    if len(replica_ranks) * len(shard_ranks) != world:
        raise ValueError(f"process_group: {len(replica_ranks)} replicas x {len(shard_ranks)} shards is not the "
                         f"world's {world} ranks; {who} agrees each step over the whole world (a mesh over part "
                         "of it is not supported)")
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    other = _other_dim(root, mesh)
    if other is None or sorted(dist.get_process_group_ranks(root.get_group(other))) != sorted(replica_ranks):
        root = None
    return Sharding(params, mesh, replicas, dist.get_rank(replicas), len(replica_ranks), root)


def _other_dim(root, mesh) -> Optional[str]:
    """The name of ``root``'s dimension beside ``mesh`` (a named 2-D root mesh), else None."""
    names = tuple(getattr(root, "mesh_dim_names", None) or ())
    mine = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if root is mesh or root.ndim != 2 or len(names) != 2 or len(mine) != 1 or mine[0] not in names:
        return None
    return names[1 - names.index(mine[0])]


def refuse_dtensors(params: Sequence[Tensor], who: str) -> None:
    """A one-line ``ValueError`` when an optimizer that takes plain parameters only is given a DTensor."""
    for i, p in enumerate(params):
        if is_dtensor(p):
            raise ValueError(f"params: parameter {i} is an FSDP2 (DTensor) parameter; {who} takes plain parameters "
                             "(LionCub and LocalCub take FSDP2's shards and vote them across replicas)")


def check_sharded_options(who: str, *, momentum_sync="none") -> None:
    """Refuse, in one line each, the options that do not work on FSDP2 parameters yet."""
    if isinstance(momentum_sync, (list, tuple)) or momentum_sync == "io":
        raise ValueError(f"momentum_sync: {momentum_sync!r} selects parameters by name or tensor, which {who} does "
                         "not map onto FSDP2's local shards yet; use 'none', 'all' or 'adaptive'")


class Sharded:
    """What an every-step optimizer with a :class:`~lioncub.engine.step.BucketStep` needs for FSDP2
    parameters (a mixin before ``torch.optim.Optimizer``; ``self.sharding`` is set by the shell)."""

    def find_sharding(self, process_group, *, momentum_sync):
        """(:func:`sharding_of` the optimizer's floating-point parameters, the group that votes: ``process_group``
        or the replicas'), after refusing the options that do not run on FSDP2 parameters."""
        who = type(self).__name__
        params = [p for g in self.param_groups for p in g["params"]]
        check_float_params(params, who)
        sharding = sharding_of(params, process_group, who)
        if sharding is None:
            return None, process_group
        check_sharded_options(who, momentum_sync=momentum_sync)
        return sharding, sharding.replicas

    def _local(self, p: Tensor) -> Tensor:
        """What the engine steps for parameter ``p``: itself, or an FSDP2 DTensor's local shard."""
        return local_of(p)

    @property
    def local_state(self):
        """The optimizer's ``state`` as the engine and the round code read it: itself, or with FSDP2 parameters a
        view keyed by the local shards (:class:`LocalState`)."""
        return self.state if getattr(self, "sharding", None) is None else LocalState(self.state, self.sharding)

    def make_sharded_state(self) -> None:
        """With FSDP2 parameters, every momentum from the start: ``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict`` runs a step with zero gradients on an optimizer without state."""
        if self.sharding is not None:
            for bucket in self.buckets:
                self.bucket_step.momenta(bucket)


@contextlib.contextmanager
def grads_on_shards(sharding: Optional[Sharding]):
    """Inside the block (a step), each local shard's ``.grad`` is its parameter's local gradient; after it,
    none (``zero_grad`` clears the DTensors' own). Nothing to do for plain parameters (``sharding`` None)."""
    if sharding is None:
        yield
        return
    sharding.hand_grads()
    try:
        yield
    finally:
        sharding.drop_grads()
