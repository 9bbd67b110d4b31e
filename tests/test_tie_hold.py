"""``tie='hold'`` on ``onebit`` (issue 34): a tied count repeats the element's last vote, kept by
its chunk owner. Exact on real 4-rank gloo groups (an even count: ties happen): the update is
the reference computed from every rank's signs, the replicas stay identical, a resume is
bit-exact, the held votes do not reshard, and the combinations it cannot run are refused."""
import io

import pytest
import torch
import torch.distributed as dist

from tests.flat import LionCub, LocalCub
from lioncub.engine.resume import reshard_states
from tests.dist import run_workers

WORLD = 4
SHAPES = [(3, 4), (8,)]  # 20 elements: chunks of 8 bits, the last one partly padding
LR, BETA1, BETA2 = 1.0, 0.5, 0.5


def _params():
    return [torch.nn.Parameter(torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) / 8)
            for s in SHAPES]


def _grad(rank, step, shape):
    """Multiples of 1/4 in [−1, 1] (dyadic; many zeros and ties across the four ranks)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + len(shape))
    return torch.randint(-4, 5, shape, generator=g).float() / 4


def _all(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _hold_run(rank, world, steps):
    """Per step: whether the update equals the reference; the ties where the held vote and the
    alternating parity differ (the rule decided them); the parameters' bytes."""
    params = _params()
    opt = LionCub(params, lr=LR, betas=(BETA1, BETA2), weight_decay=0.0, vote="onebit", tie="hold",
                  check_every=1)
    order = opt.buckets[0].params  # the message's order
    held = torch.ones(sum(p.numel() for p in order))  # +1 before the first step
    same, decided = [], 0
    for step in range(steps):
        for p, shape in zip(params, SHAPES):
            p.grad = _grad(rank, step, shape)
        c = torch.cat([(BETA1 * opt.state[p]["exp_avg"] + (1 - BETA1) * p.grad if "exp_avg" in opt.state[p]
                        else (1 - BETA1) * p.grad).reshape(-1) for p in order])
        sign = torch.where((c > 0) | ((c == 0) & (step % 2 == 0)), 1.0, -1.0)  # zeros alternate
        k = sum(torch.stack(_all(sign)).eq(1).float())
        tie = 2 * k == world
        u = torch.where(2 * k > world, 1.0, -1.0)
        u = torch.where(tie, held, u)
        decided += int((tie & (held != (1.0 if step % 2 == 0 else -1.0))).sum())
        held = u
        before = [p.detach().clone() for p in order]
        opt.step()
        got = torch.cat([(b - p.detach()).reshape(-1) / LR for b, p in zip(before, order)])
        same.append(torch.equal(got, u))
    return same, decided, [p.detach().clone() for p in params]


@pytest.mark.slow  # ~16 s; tie='hold' lost to the default rule (docs/results.md): checked after the suite
def test_ties_repeat_the_last_vote():
    out = run_workers(_hold_run, WORLD, 8)
    for same, decided, _ in out:
        assert all(same), same
        assert decided > 0  # some ties went where 'alternate' would not have sent them
    for _, _, theta in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(theta, out[0][2]))


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(params, opt, rank, start, steps):
    for step in range(start, start + steps):
        for p, shape in zip(params, SHAPES):
            p.grad = _grad(rank, step, shape)
        opt.step()


def _resume_run(rank, world):
    make = lambda ps: LionCub(ps, lr=0.25, betas=(BETA1, BETA2), vote="onebit", tie="hold")  # noqa: E731
    straight = _params()
    opt = make(straight)
    _train(straight, opt, rank, 0, 6)
    first = _params()
    opt = make(first)
    _train(first, opt, rank, 0, 3)
    sd = _roundtrip(opt.state_dict())
    held = sd["lioncub"]["server_residuals"]
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = make(resumed)
    opt.load_state_dict(sd)
    _train(resumed, opt, rank, 3, 3)
    return ([torch.equal(a, b) for a, b in zip(straight, resumed)], len(held), held[0][1].dtype,
            held[0][1].numel(), sd)


@pytest.mark.slow  # ~10 s, as above
def test_resume_is_bit_exact_and_the_held_votes_do_not_reshard():
    out = run_workers(_resume_run, WORLD)
    for equal, n_msgs, dtype, nbytes, _ in out:
        assert all(equal)
        assert (n_msgs, dtype, nbytes) == (1, torch.uint8, 1)  # 20 elements -> 4 chunks of 1 byte
    with pytest.raises(ValueError, match="tie='hold' keeps the chunk owners' last votes for the chunks of the saved"):
        reshard_states([o[4] for o in out], 2)


@pytest.mark.parametrize("make, match", [
    (lambda ps: LionCub(ps, vote="gather", tie="hold"), "tie='hold' needs chunk owners"),
    (lambda ps: LionCub(ps, vote="onebit", tie="hold", error_feedback="server"), "choose one"),
    (lambda ps: LocalCub(ps, vote="onebit", tie="hold"), "tie='hold'"),
    (lambda ps: LionCub(ps, vote="onebit", tie="hold", overlap=True), "tie='hold' keeps the chunk owners"),
    (lambda ps: LionCub(ps, vote="onebit", tie="held"), "tie must be one of"),
])
def test_what_hold_cannot_run_with_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make(_params())


def test_a_single_vote_call_refuses_hold():
    from lioncub.votes.api import reference_vote

    with pytest.raises(ValueError, match="tie='hold' repeats each chunk owner's last vote"):
        reference_vote([torch.ones(4), -torch.ones(4)], method="onebit", tie="hold")
