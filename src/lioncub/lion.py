r"""Single-process Lion: a functional core and a thin ``torch.optim.Optimizer`` shell.

For every parameter :math:`\theta` with gradient :math:`g`, momentum :math:`m`,
learning rate :math:`\eta`, betas :math:`(\beta_1, \beta_2)` and weight decay
:math:`\lambda`, one Lion step (Chen et al., "Symbolic Discovery of Optimization
Algorithms", arXiv 2302.06675; docs/design.md §1) is::

    c = β1·m + (1-β1)·g          # interpolation (g ← -g when maximize)
    θ ← θ·(1 - η·λ)              # decoupled weight decay, applied first
    θ ← θ - η·sign(c)            # sign(0) = 0
    m ← β2·m + (1-β2)·g

The step is split into pieces so that the distributed optimizer can put a vote
between them: :func:`interpolate` forms ``c``; :func:`apply_update_` applies any
update ``u`` (``sign(c)`` here, a majority vote in Lion Cub) and advances the
momentum; :func:`lion` chains them.  Each piece has a plain for-loop (the
reference) and a vectorised ``torch._foreach_*`` path that is tested against it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .chunks import chunk_cap, plan_chunks
from .validate import check_hyperparameters

FOREACH_CHUNK = 1 << 24
"""Elements :class:`Lion`'s multi-tensor step takes at once, at most (its ``c`` temporary: 64 MiB of fp32; and
at most a 16th of the group's elements, but not below 2^20: :func:`lioncub.chunks.chunk_cap`)."""

__all__ = ["Lion", "interpolate", "apply_update_", "lion"]


def _chunks(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor]) -> list[list[tuple[int, object]]]:
    """The multi-tensor step's runs: (index, slice or None for the whole tensor), by :func:`lioncub.chunks.plan_chunks`
    of at most :func:`~lioncub.chunks.chunk_cap` (``FOREACH_CHUNK``) elements of the local tensors; a tensor above
    that is cut only where its parameter, gradient and momentum allow it (:func:`_cuttable`)."""
    sizes = [_local(p).numel() for p in params]
    cap = chunk_cap(sum(sizes), FOREACH_CHUNK)
    uncut = frozenset(i for i, n in enumerate(sizes) if n > cap and not _cuttable(params[i], grads[i], exp_avgs[i]))
    return [[(pc.index, None if pc.size == sizes[pc.index] else slice(pc.lo, pc.hi)) for pc in pieces]
            for pieces in plan_chunks(sizes, cap, uncut=uncut) if pieces]


def _local(t: Tensor) -> Tensor:
    """The elements ``t`` holds on this rank: itself, or a DTensor's local tensor."""
    return t.to_local() if is_traceable_wrapper_subclass(t) and hasattr(t, "to_local") else t


def _cuttable(p: Tensor, g: Tensor, m: Tensor) -> bool:
    """Whether Lion may step slices of the three (its math is elementwise): local tensors contiguous and of one
    size, placed alike (plain tensors, or DTensors on one mesh with the same placements)."""
    locals_ = [_local(t) for t in (p, g, m)]
    if not all(x.is_contiguous() and not is_traceable_wrapper_subclass(x) and x.numel() == locals_[0].numel()
               for x in locals_):
        return False
    placed = [(getattr(t, "device_mesh", None), getattr(t, "placements", None)) for t in (p, g, m)]
    return all(x == placed[0] for x in placed)


def _part(t: Tensor, cut: Optional[slice]) -> Tensor:
    return t if cut is None else _local(t).view(-1)[cut]


def _groups_by_device_dtype(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype): the unit a fast foreach kernel accepts."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    return list(groups.values())


def _foreach_scale_(tensors: list[Tensor], factor: float) -> None:
    """``t *= factor`` for one (device, dtype) group, as ``Tensor.mul_`` would do it.

    torch's CPU ``_foreach_mul_(list, float)`` rounds the factor to the tensors' dtype
    first (in bf16, beta2 = 0.99 becomes 0.98828), unlike ``Tensor.mul_``, which
    multiplies in fp32; a float64 0-dim tensor factor keeps it exact.
    """
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.float16, torch.bfloat16):
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float64))
    else:
        torch._foreach_mul_(tensors, factor)


def _check_lengths(**lists: list[Tensor]) -> None:
    lengths = {name: len(ts) for name, ts in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"tensor lists must have equal lengths, got {lengths}")


def interpolate(
    exp_avgs: list[Tensor],
    grads: list[Tensor],
    beta1: float,
    *,
    maximize: bool = False,
    foreach: bool = False,
    out: Optional[list[Tensor]] = None,
) -> list[Tensor]:
    """Return ``c = beta1*m + (1-beta1)*g`` per tensor (``g`` negated if ``maximize``).

    The results are new tensors, or ``out`` (contiguous tensors of the same numel,
    e.g. views of one flat buffer) written in place and returned: computed in ``m``'s
    dtype, so the values are the same either way. ``exp_avgs`` and ``grads`` are left
    untouched.
    """
    _check_lengths(exp_avgs=exp_avgs, grads=grads)
    alpha = -(1.0 - beta1) if maximize else 1.0 - beta1  # -(a)·g == a·(-g) exactly
    if out is not None:
        _check_lengths(exp_avgs=exp_avgs, out=out)
        for m, g, o in zip(exp_avgs, grads, out):
            if o.numel() != m.numel() or not o.is_contiguous():
                raise ValueError(f"out tensors must be contiguous with the momenta's numel, got {tuple(o.shape)} "
                                 f"for a momentum of shape {tuple(m.shape)}")
            if o.dtype == m.dtype:
                torch.mul(m, beta1, out=o.view(m.shape)).add_(g, alpha=alpha)
            else:  # same arithmetic as without out, then cast
                o.view(m.shape).copy_(torch.mul(m, beta1).add_(g, alpha=alpha))
        return out
    if not foreach:
        return [torch.mul(m, beta1).add_(g, alpha=alpha) for m, g in zip(exp_avgs, grads)]
    out: list[Optional[Tensor]] = [None] * len(exp_avgs)
    for idx in _groups_by_device_dtype(exp_avgs):
        cs = torch._foreach_mul([exp_avgs[i] for i in idx], beta1)
        torch._foreach_add_(cs, [grads[i] for i in idx], alpha=alpha)
        for i, c in zip(idx, cs):
            out[i] = c
    return out  # type: ignore[return-value]


def apply_update_(
    params: list[Tensor],
    updates: list[Tensor],
    exp_avgs: list[Tensor],
    grads: list[Tensor],
    *,
    lr: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    foreach: bool = False,
) -> None:
    """In place: ``p ← p·(1-lr·wd)``; ``p ← p - lr·u``; ``m ← beta2·m + (1-beta2)·g``.

    ``updates`` may be any real tensors broadcastable to the params (``sign(c)``,
    or an integer majority vote); they are scaled by ``lr`` and not re-signed.
    """
    _check_lengths(params=params, updates=updates, exp_avgs=exp_avgs, grads=grads)
    decay = 1.0 - lr * weight_decay
    alpha = -(1.0 - beta2) if maximize else 1.0 - beta2
    if not foreach:
        for p, u, m, g in zip(params, updates, exp_avgs, grads):
            if weight_decay != 0:
                p.mul_(decay)
            p.add_(u, alpha=-lr)
            m.mul_(beta2).add_(g, alpha=alpha)
        return
    for idx in _groups_by_device_dtype(params):
        ps = [params[i] for i in idx]
        ms = [exp_avgs[i] for i in idx]
        if weight_decay != 0:
            _foreach_scale_(ps, decay)
        torch._foreach_add_(ps, [updates[i] for i in idx], alpha=-lr)
        _foreach_scale_(ms, beta2)
        torch._foreach_add_(ms, [grads[i] for i in idx], alpha=alpha)


def lion(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    foreach: bool = False,
) -> None:
    """One full Lion step in place: :func:`interpolate` → sign (sign(0)=0) → :func:`apply_update_`."""
    _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs)
    cs = interpolate(exp_avgs, grads, beta1, maximize=maximize, foreach=foreach)
    if foreach:
        torch._foreach_sign_(cs)
    else:
        for c in cs:
            c.sign_()
    apply_update_(params, cs, exp_avgs, grads, lr=lr, beta2=beta2,
                  weight_decay=weight_decay, maximize=maximize, foreach=foreach)


class Lion(torch.optim.Optimizer):
    r"""Lion optimizer (arXiv 2302.06675; docs/design.md §1).

    For each parameter, with :math:`\eta` = ``lr``, :math:`\lambda` = ``weight_decay``::

        c = β1·m + (1-β1)·g          # g ← -g when maximize
        θ ← θ·(1 - η·λ)
        θ ← θ - η·sign(c)            # sign(0) = 0
        m ← β2·m + (1-β2)·g

    Weight decay is ``lr·weight_decay`` with each group's own ``lr`` (never
    divided by the constructor's ``lr``), so per-group ``lr`` and LR schedulers
    scale it too.  Lion's update has unit size per coordinate, so its ``lr`` is
    typically 3-10× smaller and ``weight_decay`` 3-10× larger than AdamW's.

    Args:
        params: parameters or param-group dicts (each may set ``lr``, ``betas``,
            ``weight_decay``, ``maximize``, ``foreach``).
        lr: learning rate η >= 0.
        betas: (β1, β2), each in [0, 1): interpolation and momentum decay.
        weight_decay: λ >= 0, decoupled.
        maximize: ascend instead of descend (momentum then tracks -g).
        foreach: ``True`` for the vectorised ``torch._foreach_*`` path, ``False``
            for the plain loop (the reference); ``None`` picks foreach when all of a
            group's tensors share one device.

    State per parameter: ``'exp_avg'`` (m), in the parameter's dtype.

    Example:
        >>> import torch
        >>> from lioncub.lion import Lion
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> loss.backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
    ) -> None:
        check_hyperparameters(lr, betas, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                        maximize=maximize, foreach=foreach)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]  # now filled with defaults
        try:
            check_hyperparameters(group["lr"], group["betas"], group["weight_decay"])
            for p in group["params"]:
                if p.is_complex():
                    raise TypeError("params: Lion supports real floating-point parameters only; "
                                    f"got dtype {p.dtype} (view complex tensors as real pairs "
                                    "with torch.view_as_real)")
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)

    def _init_group(self, group: dict, params: list, grads: list, exp_avgs: list) -> None:
        """Collect the group's params that have gradients; create missing state."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError("Lion does not support sparse gradients; use dense gradients "
                                "(e.g. torch.nn.Embedding(..., sparse=False))")
            state = self.state[p]
            if len(state) == 0:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one Lion step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            self._init_group(group, params, grads, exp_avgs)
            if not params:
                continue
            foreach = group["foreach"]
            if foreach is None:
                foreach = len({t.device for t in params + grads + exp_avgs}) == 1
            beta1, beta2 = group["betas"]
            # the multi-tensor ops make c for all their tensors at once: a chunk of them at a time keeps that
            # temporary to FOREACH_CHUNK elements and a 16th of the group (a larger tensor in slices)
            for run in _chunks(params, grads, exp_avgs) if foreach else [[(i, None) for i in range(len(params))]]:
                lion([_part(params[i], cut) for i, cut in run], [_part(grads[i], cut) for i, cut in run],
                     [_part(exp_avgs[i], cut) for i, cut in run], lr=group["lr"], beta1=beta1, beta2=beta2,
                     weight_decay=group["weight_decay"], maximize=group["maximize"], foreach=foreach)
        return loss
