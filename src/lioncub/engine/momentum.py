r"""Momentum synchronisation for LionCub (docs/design.md §5; the paper's §5).

In Lion Cub every rank keeps its own momentum :math:`m_i`, so momenta drift apart.
Every ``every`` completed steps, a policy averages some of them across the P ranks::

    m_i ← (1/P) Σ_j m_j          # one SUM all-reduce in fp32 (or bf16: half the bytes)

==============  ===================================================================
policy          tensors averaged every ``every`` steps
==============  ===================================================================
``'none'``      none (the default; the paper needs none with β2 = 0.99)
``'all'``       every parameter's momentum
``'io'``        the input embedding(s) and the output layer (:func:`io_parameters`),
                the paper's choice with β2 = 0.95; a tied embedding/head is one
                tensor and is averaged once
``[...]``       an explicit list of parameter names (needs ``model``) or tensors
``'adaptive'``  those whose measured divergence exceeds a threshold (:class:`Adaptive`)
==============  ===================================================================

The all-reduces go through :func:`lioncub.comm.all_reduce`, so their bytes land in the
step's :class:`~lioncub.comm.CommStats` (``2(P-1)/P · B`` per rank for ``B`` bytes).

Adaptive policy (beyond the paper). Per tensor, the relative divergence

.. math:: r = \frac{\sum_i \lVert m_i - \bar m\rVert^2}{\sum_i \lVert m_i\rVert^2} \in [0, 1]

is 0 for identical momenta and :math:`(P-1)/P` for independent zero-mean ones. It is
estimated from a *sketch*: the tensor is cut into ``buckets`` contiguous chunks and
each chunk's elements are summed with random signs shared by all ranks,
:math:`z_b = \sum_{j \in b} s_j m_j`. The sketch is linear, so
:math:`E\lVert z(m_i) - z(\bar m)\rVert^2 = \lVert m_i - \bar m\rVert^2`; one all-reduce of
``T·(buckets+1)`` float64 values (T tensors) gives every rank the same estimate
(relative error about :math:`\sqrt{2/\text{buckets}}`). Cost per check: one random sign
and one multiply-add per element, and ``8·T·(buckets+1)·2(P-1)/P`` bytes sent per rank.
Tensors with ``r > threshold`` are then averaged.

What it finds (``examples/instruments_gpt.py``, gpt-tiny, 4 workers, 4×64 tokens per
worker, β2 = 0.99, 300 steps): r is 0.5–0.96 in almost every tensor (gradient noise
dominates at this batch size), so with threshold 0.25 it averaged nearly every block on
most checks but the head only 3 times in 30. It does *not* single out the embedding and
head; the paper's absolute statistic (max std, :func:`lioncub.instruments.live_momentum_std`)
does rank ``wte`` and ``head`` 1st and 3rd there. r is scale-free by design; measure first.

Example::

    opt = LionCub(model.parameters(), betas=(0.9, 0.95), model=model, options=Options(momentum_sync="io"))
    opt = LionCub(model.parameters(), model=model, options=Options(momentum_sync=Adaptive(threshold=0.3)))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor

from .. import chunks, comm
from . import cost
from ..comm import CommStats
from ..validate import check_int

__all__ = ["Adaptive", "MomentumSync", "POLICIES", "SYNC_DTYPES", "io_parameters", "label_params",
           "divergence_sketch", "sync_bytes"]

POLICIES = ("none", "all", "io", "adaptive")
SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Adaptive:
    """The adaptive policy's settings (``momentum_sync='adaptive'`` uses the defaults)."""

    threshold: float = 0.25
    """Average a tensor's momentum when its relative divergence ``r`` exceeds this."""
    buckets: int = 64
    """Sketch size per tensor; a tensor with at most this many elements is sent whole (exact r)."""
    seed: int = 0
    """Seeds the sketch signs (the same on every rank; the check count is mixed in)."""

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        check_int("buckets", self.buckets, 1)


def label_params(params: list[Tensor], model: nn.Module | None) -> list[str]:
    """A label per tensor of ``params`` for reports: its first name in ``model`` (tied tensors
    are listed once), else ``param{i}``; never None, unlike :func:`lioncub.engine.guard.param_names`."""
    names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def io_parameters(model: nn.Module) -> list[Tensor]:
    """The input embedding(s) and the output layer of ``model``, each tensor once.

    Input: every ``nn.Embedding`` (token and position tables), or, when there is none,
    the first module with parameters (a ResNet stem conv, a ViT patch embedding).
    Output: the last ``nn.Linear`` in registration order (else the last module with
    parameters). A head tied to the token embedding is the same tensor: listed once.
    A model that says which parameters are which — ``param_roles()`` returning
    ``{name: 'embed' | 'head' | ...}``, as the harness's GPT, ResNet and ViT do (a ViT's patch
    projection, position table and class token are all its input) — gets exactly its
    ``embed`` and ``head`` parameters. Models with Hugging Face's
    ``get_input_embeddings``/``get_output_embeddings`` use those.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    roles = model.param_roles() if callable(getattr(model, "param_roles", None)) else {}
    declared = [p for n, p in model.named_parameters() if roles.get(n) in ("embed", "head")]
    if declared:
        return declared  # named_parameters lists a tied tensor once
    if hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings"):
        modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    else:
        owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        if not owners:
            raise ValueError("model has no parameters")
        inputs = [m for m in owners if isinstance(m, nn.Embedding)] or [owners[0]]
        linears = [m for m in owners if isinstance(m, nn.Linear)]
        modules = inputs + [linears[-1] if linears else owners[-1]]
    out, seen = [], set()
    for m in modules:
        for p in ([] if m is None else m.parameters(recurse=False)):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


SKETCH_SLICE = 1 << 20
"""Elements of float64 work :func:`divergence_sketch` holds at once (8 MiB), whatever the tensor's size."""


def divergence_sketch(m: Tensor, buckets: int, generator: torch.Generator) -> Tensor:
    """Signed chunk sums of ``m`` (float64, ``min(buckets, numel)`` values); see the module doc.

    A tensor of at most ``buckets`` elements is returned whole (no signs drawn), so its
    divergence is exact. Ranks must pass generators in the same state.
    """
    flat = m.detach().reshape(-1)
    n = flat.numel()
    if n <= buckets:
        return flat.double().clone()
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int8, device=flat.device)  # 1 B each
    width = -(-n // buckets)  # elements per chunk; the last chunk is zero-padded
    out = torch.empty(buckets, dtype=torch.float64, device=flat.device)
    rows = max(1, SKETCH_SLICE // width)  # float64 work for this many chunks at a time, not the tensor's
    for r0 in range(0, buckets, rows):
        r1 = min(buckets, r0 + rows)
        a, b = min(n, r0 * width), min(n, r1 * width)
        piece = torch.zeros((r1 - r0) * width, dtype=torch.float64, device=flat.device)
        piece[:b - a] = flat[a:b].double() * signs[a:b].double().mul_(2).sub_(1)
        out[r0:r1] = piece.view(r1 - r0, width).sum(dim=1)
    return out  # (buckets,)


def sync_bytes(n: int, world_size: int, *, dtype: str = "fp32", every: int = 1) -> float:
    """Bytes one rank sends per step, on average, to average ``n`` momentum elements every
    ``every`` steps: an all-reduce of ``n`` elements in ``dtype`` (``cost``'s ring arithmetic)."""
    if dtype not in SYNC_DTYPES:
        raise ValueError(f"sync_dtype must be one of {tuple(SYNC_DTYPES)}, got {dtype!r}")
    return cost.predicted_bytes("grad", n, world_size, grad_dtype=dtype)["bytes_sent"] / every


def _resolve(policy, params: list[Tensor], model) -> tuple[str, list[int]]:
    """(kind, indices into ``params``) for a policy; raises ValueError/TypeError for bad input."""
    if isinstance(policy, Adaptive):
        return "adaptive", list(range(len(params)))
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"momentum_sync must be one of {POLICIES}, an Adaptive(...) or a list of "
                             f"parameter names/tensors, got {policy!r}")
        if policy == "none":
            return "none", []
        if policy in ("all", "adaptive"):
            return policy, list(range(len(params)))
        if model is None:
            raise ValueError("momentum_sync='io' needs model= (the module the parameters come from)")
        chosen = io_parameters(model)
        kind = "io"
    elif isinstance(policy, (list, tuple)):
        if not policy:
            raise ValueError("momentum_sync selection is empty; use momentum_sync='none' to sync nothing")
        named = None if model is None else dict(model.named_parameters(remove_duplicate=False))
        chosen = []
        for item in policy:
            if isinstance(item, Tensor):
                chosen.append(item)
            elif isinstance(item, str):
                if named is None:
                    raise ValueError("momentum_sync given parameter names needs model=")
                if item not in named:
                    raise ValueError(f"momentum_sync names unknown parameter {item!r}; "
                                     f"the model has {sorted(named)[:8]}...")
                chosen.append(named[item])
            else:
                raise TypeError(f"momentum_sync list items must be parameter names or tensors, "
                                f"got {type(item).__name__}")
        kind = "explicit"
    else:
        raise TypeError(f"momentum_sync must be a str, an Adaptive(...) or a list, got {type(policy).__name__}")
    index = {id(p): i for i, p in enumerate(params)}
    missing = [t for t in chosen if id(t) not in index]
    if missing:
        raise ValueError(f"momentum_sync selects {len(missing)} tensor(s) the optimizer does not hold "
                         f"(shapes {[tuple(t.shape) for t in missing]})")
    return kind, sorted({index[id(t)] for t in chosen})


class MomentumSync:
    """Averages selected momenta across ranks every ``every`` completed steps (see module doc).

    LionCub builds one from its ``momentum_sync``, ``sync_every``, ``sync_dtype`` and
    ``model`` arguments, its parameters, group and bucket size, and calls :meth:`after_step`
    with its step count and state after every completed step. Attributes: ``kind``,
    ``selected`` (indices into ``params``), ``names`` (every param's name), ``n_syncs``,
    ``n_checks``, ``bytes_sent`` (momentum traffic so far, per rank), ``sync_counts``
    (name -> times averaged) and ``last_divergence`` (name -> r, adaptive).
    """

    def __init__(self, policy="none", *, every: int = 10, dtype: str = "fp32", model=None,
                 params: Sequence[Tensor] = (), group=None, world_size: int = 1, chunk_mb: float = 25.0):
        check_int("sync_every", every, 1)
        if dtype not in SYNC_DTYPES:
            raise ValueError(f"sync_dtype must be one of {tuple(SYNC_DTYPES)}, got {dtype!r}")
        self.params = list(params)
        self.group, self.world_size = group, world_size
        self.chunk = max(1, int(chunk_mb * 2**20 / 4))  # elements per momentum all-reduce
        self.kind, self.selected = _resolve(policy, self.params, model)
        self.adaptive = policy if isinstance(policy, Adaptive) else Adaptive() if self.kind == "adaptive" else None
        self.every, self.dtype = every, dtype
        self.names = label_params(self.params, model)
        self.n_syncs, self.n_checks, self.bytes_sent = 0, 0, 0.0
        self.sync_counts: dict[str, int] = {}
        self.last_divergence: dict[str, float] = {}

    def after_step(self, steps: int, state, stats: CommStats) -> None:
        """After ``steps`` completed steps: average what the policy selects (collective on its
        step). ``state``: the optimizer's per-parameter state (``state[p]['exp_avg']``)."""
        if self.kind == "none" or self.world_size == 1 or steps % self.every:
            return
        idx = [i for i in self.selected if "exp_avg" in state[self.params[i]]]
        if self.kind == "adaptive":
            r = self.divergence(state, idx, stats)
            idx = [i for i in idx if r[i] > self.adaptive.threshold]
        self.average(state, idx, stats)

    def divergence(self, state, idx: list[int], stats: CommStats | None = None) -> dict[int, float]:
        """Relative divergence r per param index, estimated with one small all-reduce (collective)."""
        if not idx:
            self.n_checks += 1
            return {}
        momenta = [state[self.params[i]]["exp_avg"] for i in idx]
        # the same seed on every rank: the same signs (a generator of the momenta's device)
        gen = comm.make_generator(momenta[0].device, self.adaptive.seed * 1_000_003 + self.n_checks)
        self.n_checks += 1
        sk = [divergence_sketch(m, self.adaptive.buckets, gen) for m in momenta]
        buf = torch.cat(sk + [torch.stack([z.square().sum() for z in sk])])  # [z_1 .. z_T, ||z_t||²]
        self._all_reduce(buf, stats)
        sums = buf[: buf.numel() - len(idx)].split([z.numel() for z in sk])  # Σ_i z_i per tensor
        sq = buf[buf.numel() - len(idx):]  # Σ_i ||z_i||² per tensor
        both = torch.stack([sq, torch.stack([z.square().sum() for z in sums])]).tolist()  # one host read
        out = {}
        for k, i in enumerate(idx):
            den = both[0][k]
            num = den - both[1][k] / self.world_size
            out[i] = max(0.0, num / den) if den > 0 else 0.0
            self.last_divergence[self.names[i]] = out[i]
        return out

    @torch.no_grad()
    def average(self, state, idx: list[int], stats: CommStats | None = None) -> None:
        """Replace the momenta of params ``idx`` by their mean over ranks (collective)."""
        if not idx:
            return
        ms = [state[self.params[i]]["exp_avg"] for i in idx]
        for chunk in _chunks(ms, self.chunk):
            flat = torch.cat([m.reshape(-1).to(SYNC_DTYPES[self.dtype]) for m in chunk])
            self._all_reduce(flat, stats)
            flat.div_(self.world_size)
            for m, piece in zip(chunk, flat.split([m.numel() for m in chunk])):
                m.copy_(piece.view_as(m))
        self.n_syncs += 1
        for i in idx:
            self.sync_counts[self.names[i]] = self.sync_counts.get(self.names[i], 0) + 1

    def _all_reduce(self, t: Tensor, stats: CommStats | None) -> None:
        mine = CommStats()
        mine.sync = getattr(stats, "sync", None)  # timed as the step is
        comm.all_reduce(t, self.group, mine)
        self.bytes_sent += mine.bytes_sent
        if stats is not None:
            stats.add(mine)

    def selected_names(self) -> list[str]:
        return [self.names[i] for i in self.selected]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "n_syncs": self.n_syncs, "n_checks": self.n_checks,
                "bytes_sent": self.bytes_sent, "sync_counts": dict(self.sync_counts),
                "last_divergence": dict(self.last_divergence)}

    def load_state_dict(self, state: dict) -> None:
        self.n_syncs = int(state.get("n_syncs", 0))
        self.n_checks = int(state.get("n_checks", 0))  # the adaptive sketch seed: resumes exactly
        self.bytes_sent = float(state.get("bytes_sent", 0.0))
        self.sync_counts = dict(state.get("sync_counts", {}))
        self.last_divergence = dict(state.get("last_divergence", {}))


def _chunks(ms: list[Tensor], limit: int):
    return [[ms[k] for k in run] for run in chunks.runs([m.numel() for m in ms], limit)]
