"""The tie rule (``tie='alternate'|'plus'|'minus'``) through LionCub.step, element for element
against reference_vote, on real gloo groups of 2 and 3 ranks, on the fused and the torch path,
with and without overlap. Inputs hold exact zeros of c (on every rank and on one rank only)
and tied votes, so a rule that is not applied changes u and fails the check."""
import pytest
import torch

from lioncub import LionCub, majority_vote, reference_vote, votes
from lioncub.vote import TIE_RULES
from tests.dist import run_workers

N = 999  # not a multiple of 8: packed tails are exercised
CASES = [("onebit", None), ("gather", None), ("pbit", None), ("pbit", 8)]


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
            for method, bits in CASES:
                for tie in TIE_RULES:
                    p = torch.nn.Parameter(torch.zeros(N))
                    lr, beta1 = 0.5, 0.9
                    opt = LionCub([p], lr=lr, betas=(beta1, 0.99), vote=method, bits=bits, tie=tie,
                                  overlap=overlap, fused=None if use_fused else False)
                    for step in range(3):
                        g = _grad(rank, step)
                        m = opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else torch.zeros(N)
                        c = beta1 * m + (1 - beta1) * g  # Lion's c, zeros exactly where m and g are 0
                        cs = [torch.empty_like(c) for _ in range(world)]
                        dist.all_gather(cs, c)
                        want = reference_vote(cs, method=method, bits=bits, step=step, tie=tie)
                        before = p.detach().clone()
                        p.grad = g
                        opt.step()
                        u = (before - p.detach()) / lr  # weight_decay 0: θ ← θ − η·u, exact for η = 0.5
                        where = (method, bits, tie, step, use_fused, overlap)
                        assert torch.equal(u, want), where
                        zero = torch.stack(cs).eq(0).all(0)
                        assert zero.any(), where
                        if method == "onebit":  # zeros (and ties) follow the rule
                            rule = {"plus": 1.0, "minus": -1.0}.get(tie, 1.0 if step % 2 == 0 else -1.0)
                            assert (u[zero] == rule).all(), where
                        ties += int((torch.stack([x.sign() for x in cs]).sum(0) == 0).sum())
                        checked += 1
                    opt.remove_hooks()
    return checked, ties


@pytest.mark.parametrize("world", [2, 3])
def test_lioncub_step_applies_the_tie_rule(world):
    results = run_workers(_tie_worker, world)
    assert results[0][0] == 2 * 2 * len(CASES) * len(TIE_RULES) * 3
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
    with pytest.raises(ValueError, match=r"tie must be one of \('alternate', 'plus', 'minus'\), got 'random'"):
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
