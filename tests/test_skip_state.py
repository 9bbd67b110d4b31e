"""A skipped step leaves every piece of the optimizer's state as it was (issue 45, hole 5).

``nonfinite='skip'``: when any rank's gradient holds a NaN, every rank drops the step. On 3 gloo ranks,
for each option that keeps state beyond Lion's momentum (worker and chunk-owner error-feedback
residuals, the held votes of ``tie='hold'``, the 1-bit mean's shared momentum, magnitudes and restart
count, the stochastic quantizer's generator), the complete ``state_dict()`` and the generator's state
after the skipped step equal, bit for bit, what they were before it; only ``skipped_steps`` moves
(by one), and the parameters are untouched.
"""
from __future__ import annotations

import torch

from tests.flat import LionCub
from tests.dist import run_workers

OPTIONS = [
    dict(vote="pbit", error_feedback="worker"),
    dict(vote="onebit", error_feedback="server"),
    dict(vote="onebit", error_feedback="both"),
    dict(vote="onebit", tie="hold"),
    dict(vote="onebit", aggregate="mean", mean_restart=3),
    dict(vote="pbit", stochastic_signs=True, seed=5),
]


def _flat(obj, prefix=""):
    """Every leaf of a state dict as (path, value): tensors cloned, the rest as they are."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _flat(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _flat(v, f"{prefix}/{i}")]
    return [(prefix, obj.clone() if torch.is_tensor(obj) else obj)]


def _same(a, b) -> list[str]:
    """The paths where two flattened states differ (keys, dtypes or values)."""
    if [k for k, _ in a] != [k for k, _ in b]:
        return ["keys: " + str(sorted(set(k for k, _ in a) ^ set(k for k, _ in b)))]
    return [k for (k, x), (_, y) in zip(a, b)
            if (torch.is_tensor(x) and not (torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)))
            or (not torch.is_tensor(x) and x != y)]


def _worker(rank, world):
    out = []
    for cfg in OPTIONS:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(9, 7)), torch.nn.Parameter(torch.randn(13))]
        opt = LionCub(params, lr=1e-2, nonfinite="skip", **cfg)
        for step in range(3):  # state to keep: residuals, held votes, the mean's momentum and magnitudes
            g = torch.Generator().manual_seed(100 * step + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 2 and rank == 1:
                params[0].grad[3, 4] = float("nan")
            if step == 2:
                before = _flat(opt.state_dict())
                gen = opt.generator.get_state().clone() if opt.generator is not None else None
                theta = [p.detach().clone() for p in params]
            opt.step()
        after = _flat(opt.state_dict())
        counters = [k for k, _ in before if k.endswith("skipped_steps")]
        moved = dict(after)[counters[0]] - dict(before)[counters[0]] if counters else None
        diff = _same([x for x in before if x[0] not in counters], [x for x in after if x[0] not in counters])
        gen_same = gen is None or torch.equal(gen, opt.generator.get_state())
        out.append((diff, moved, gen_same, all(torch.equal(a, b) for a, b in zip(theta, params)),
                    len(before), opt.generator is not None))
    return out


def test_a_skipped_step_leaves_every_state_entry_unchanged():
    for res in run_workers(_worker, 3):
        for cfg, (diff, moved, gen_same, params_same, n, has_gen) in zip(OPTIONS, res):
            assert diff == [] and moved == 1 and gen_same and params_same, (cfg, diff, moved)
            assert n > 6, (cfg, n)  # the snapshot holds the option's own state, not just Lion's momenta
        assert res[-1][5]  # the stochastic run has a generator to keep
