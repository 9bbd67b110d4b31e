"""The tie rule (``tie='alternate'|'plus'|'minus'``) through LionCub.step, element for element
against reference_vote, on real gloo groups of 2 and 3 ranks, on the fused and the torch path,
with and without overlap. Inputs hold exact zeros of c (on every rank and on one rank only)
and tied votes, so a rule that is not applied changes u and fails the check. The quantized
pbit votes take no tie rule (a zero of c quantizes to 0, a tied sum votes 0): every
quantizer goes through the same steps against reference_vote, with ``tie='alternate'``."""
import pytest
import torch

from lioncub import majority_vote, reference_vote, votes
from tests.flat import LionCub
from lioncub.votes.api import TIE_RULES as ALL_TIE_RULES

TIE_RULES = tuple(t for t in ALL_TIE_RULES if t != "hold")  # 'hold' keeps owner state: tests/test_tie_hold.py
from tests.dist import run_workers

N = 999  # not a multiple of 8: packed tails are exercised
CASES = [("onebit", None), ("gather", None), ("pbit", None), ("pbit", 8)]
QUANTIZED = [("pbit", None, "sign"), ("pbit", None, "l1"), ("pbit", 4, "l1"), ("pbit", 8, "lp"), ("pbit", None, "l0"),
             ("pbit", 8, "linf"), ("pbit", 4, "linf"), ("pbit", None, "log")]
RUNS = [(m, b, None, tie) for m, b in CASES for tie in TIE_RULES] + [(m, b, q, "alternate") for m, b, q in QUANTIZED]


def _grad(rank, step):
    """This rank's gradient: random signs (2 ranks tie on about half the coordinates),
    zeros on every rank at [::5] (so c and m stay exactly 0 there) and on this rank at
    [rank::7] for this step."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))
    g[::5] = 0.0
    g[rank::7] = 0.0
    return g


def _tie_worker(rank, world):
    import torch.distributed as dist

    checked, ties = 0, 0
    for use_fused in (True, False):
        for overlap in (False, True):
            for method, bits, quantizer, tie in RUNS:
                p = torch.nn.Parameter(torch.zeros(N))
                lr, beta1 = 0.5, 0.9
                opt = LionCub([p], lr=lr, betas=(beta1, 0.99), vote=method, bits=bits, quantizer=quantizer, tie=tie,
                              overlap=overlap, fused=None if use_fused else False)
                for step in range(3):
                    g = _grad(rank, step)
                    m = opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else torch.zeros(N)
                    # Lion's c, zeros exactly where m and g are 0; in the optimizer's op order (fma), so a
                    # quantizer's scale (one bucket: all of p) is the optimizer's to the last bit
                    c = torch.mul(m, beta1).add_(g, alpha=1 - beta1)
                    cs = [torch.empty_like(c) for _ in range(world)]
                    dist.all_gather(cs, c)
                    gens = None
                    if quantizer == "linf":  # each rank's generator as the step will draw from it
                        states = [torch.empty_like(opt.generator.get_state()) for _ in range(world)]
                        dist.all_gather(states, opt.generator.get_state())
                        gens = [torch.Generator().set_state(x) for x in states]
                    want = reference_vote(cs, method=method, bits=bits, quantizer=quantizer, step=step, tie=tie,
                                          generators=gens)
                    before = p.detach().clone()
                    p.grad = g
                    opt.step()
                    u = (before - p.detach()) / lr  # weight_decay 0: θ ← θ − η·u, exact for η = 0.5
                    where = (method, bits, quantizer, tie, step, use_fused, overlap)
                    assert torch.equal(u, want), ("u", where)
                    zero = torch.stack(cs).eq(0).all(0)
                    assert zero.any(), where
                    if method == "onebit":  # zeros (and ties) follow the rule
                        rule = {"plus": 1.0, "minus": -1.0}.get(tie, 1.0 if step % 2 == 0 else -1.0)
                        assert (u[zero] == rule).all(), ("rule", where)
                    if quantizer is not None:  # no rule: a zero everywhere quantizes to 0 and votes 0
                        assert (u[zero] == 0).all(), ("zeros", where)
                    ties += int((torch.stack([x.sign() for x in cs]).sum(0) == 0).sum())
                    checked += 1
                opt.remove_hooks()
    return checked, ties


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lioncub_step_applies_the_tie_rule(world):
    results = run_workers(_tie_worker, world)
    assert results[0][0] == 2 * 2 * len(RUNS) * 3
    assert results[0][1] > 100  # ties of the signs (with zeros) were exercised


def _vote_worker(rank, world):
    """majority_vote with each rule against reference_vote (the collective alone)."""
    import torch.distributed as dist

    out = 0
    for step in (0, 1):
        c = _grad(rank, step)
        cs = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(cs, c)
        for method, bits in CASES:
            for tie in TIE_RULES:
                u = majority_vote(c, method=method, bits=bits, step=step, tie=tie)
                assert torch.equal(u, reference_vote(cs, method=method, bits=bits, step=step, tie=tie)), \
                    (method, bits, tie, step)
                out += 1
    return out


def test_majority_vote_applies_the_tie_rule():
    assert run_workers(_vote_worker, 2)[0] == 2 * len(CASES) * len(TIE_RULES)


def test_reference_rules_by_hand():
    # 2 workers: [+,-] tie, [0,0] zeros, [+,0] one zero, [+,+]
    cs = [torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([-1.0, 0.0, 0.0, 3.0])]
    assert reference_vote(cs, method="onebit", step=0).tolist() == [1, 1, 1, 1]
    assert reference_vote(cs, method="onebit", step=1).tolist() == [-1, -1, -1, 1]  # [+,0] -> [+,-]: tie
    for step in (0, 1):
        assert reference_vote(cs, method="onebit", step=step, tie="plus").tolist() == [1, 1, 1, 1]
        assert reference_vote(cs, method="onebit", step=step, tie="minus").tolist() == [-1, -1, -1, 1]
        # gather / binary pbit: the rule sets the zeros' bits, ties still vote 0
        assert reference_vote(cs, method="gather", step=step, tie="plus").tolist() == [0, 1, 1, 1]
        assert reference_vote(cs, method="pbit", step=step, tie="minus").tolist() == [0, -1, 0, 1]


def test_tie_is_validated():
    with pytest.raises(ValueError, match=r"tie must be one of \('alternate', 'plus', 'minus', 'hold'\), got 'random'"):
        LionCub([torch.nn.Parameter(torch.zeros(3))], vote="onebit", tie="random")
    for kw in (dict(vote="grad"), dict(vote="sign_allreduce"), dict(vote="pbit", quantizer="l1"),
               dict(vote="auto")):
        with pytest.raises(ValueError, match="tie='plus' applies to the 1-bit paths only"):
            LionCub([torch.nn.Parameter(torch.zeros(3))], tie="plus", **kw)
    with pytest.raises(ValueError, match="tie must be one of"):
        majority_vote(torch.zeros(3), method="onebit", tie="even")
    with pytest.raises(ValueError, match="tie='minus' applies to the 1-bit paths only"):
        reference_vote([torch.zeros(3)], method="sign_allreduce", tie="minus")
    with pytest.raises(ValueError, match="tie must be one of"):
        votes.make("onebit", 2, tie=None)
    # the default is accepted everywhere
    LionCub([torch.nn.Parameter(torch.zeros(3))], vote="grad", tie="alternate")
