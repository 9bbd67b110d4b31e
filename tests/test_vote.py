"""Every vote method against the exact reference, on real gloo groups of 2, 3 and 4 ranks."""
import pytest
import torch

from lioncub.votes.api import VOTE_METHODS, majority_vote, reference_vote
from tests.dist import run_workers

SIZES = [0, 1, 7, 8, 9, 100, 1001, 4099]
CONFIGS = [
    ("sign_allreduce", None, None),
    ("gather", None, None),
    ("onebit", None, None),
    ("pbit", None, None),  # binary signs, smallest lane
    ("pbit", 8, None),
    ("pbit", None, "sign"),
    ("pbit", None, "l1"),
    ("pbit", 4, "l1"),
    ("pbit", 8, "l0"),
    ("pbit", 8, "lp"),
    ("pbit", 8, "linf"),
    ("pbit", 8, "log"),
]


def _inputs(world, n, seed):
    """All ranks' c: Laplace-like values with exact zeros and forced ties."""
    g = torch.Generator().manual_seed(seed)
    cs = []
    for _ in range(world):
        mag = torch.distributions.Laplace(0.0, 1.0).sample((n,)) if n else torch.zeros(0)
        keep = torch.randint(0, 4, (n,), generator=g) > 0  # ~25% exact zeros
        cs.append(mag * keep)
    if n >= 4 and world % 2 == 0:  # first 4 coordinates: exact ties of signs
        for i, c in enumerate(cs):
            c[:4] = 1.0 if i < world // 2 else -1.0
    return cs


def _check_all(rank, world):
    torch.manual_seed(0)  # Laplace sampling uses the global generator: same on all ranks
    checked = 0
    for n in SIZES:
        for step in (0, 1):
            cs = _inputs(world, n, seed=1000 * n + step)
            for method, bits, quantizer in CONFIGS:
                if method == "pbit" and quantizer not in (None, "sign") and bits == 4 and world > 7:
                    continue
                gens = [torch.Generator().manual_seed(7 + r) for r in range(world)]
                my_gen = torch.Generator().manual_seed(7 + rank)
                u = majority_vote(cs[rank], method=method, bits=bits, quantizer=quantizer,
                                  step=step, generator=my_gen)
                ref = reference_vote(cs, method=method, bits=bits, quantizer=quantizer,
                                     step=step, generators=gens)
                assert u.shape == cs[rank].shape and u.dtype == cs[rank].dtype
                assert torch.equal(u, ref), (method, bits, quantizer, n, step)
                c = cs[rank].clone()  # out=c: u written over c itself (what LionCub does)
                same = majority_vote(c, method=method, bits=bits, quantizer=quantizer, step=step,
                                     generator=torch.Generator().manual_seed(7 + rank), out=c)
                assert same is c and torch.equal(c, ref), ("out=c", method, bits, quantizer, n, step)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_method_matches_reference(world):
    counts = run_workers(_check_all, world)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_out_must_match_c():
    c = torch.zeros(4)
    for bad in (torch.zeros(5), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match="out must be a contiguous tensor of c's shape"):
            majority_vote(c, method="onebit", out=bad)


def test_reference_semantics_by_hand():
    # 4 workers, element-wise signs: [+,+,-,-] tie, [+,+,+,-] -> +, zeros
    cs = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 2.0, 0.0]),
          torch.tensor([-1.0, 3.0, 0.0]), torch.tensor([-2.0, -1.0, 0.0])]
    assert reference_vote(cs, method="sign_allreduce").tolist() == [0, 1, 0]
    # 1-bit wire: zeros become +1 on even steps, -1 on odd; ties follow the parity too
    assert reference_vote(cs, method="onebit", step=0).tolist() == [1, 1, 1]
    assert reference_vote(cs, method="onebit", step=1).tolist() == [-1, 1, -1]
    # gather votes locally at full precision: ties -> 0, zeros still travel as parity bits
    assert reference_vote(cs, method="gather", step=0).tolist() == [0, 1, 1]
    assert reference_vote(cs, method="pbit", step=1).tolist() == [0, 1, -1]
    assert reference_vote(cs, method="pbit", quantizer="sign").tolist() == [0, 1, 0]


def test_method_names_are_validated():
    assert set(VOTE_METHODS) == {"sign_allreduce", "gather", "onebit", "pbit"}
    with pytest.raises(ValueError, match="method must be one of"):
        reference_vote([torch.zeros(3)], method="nope")
