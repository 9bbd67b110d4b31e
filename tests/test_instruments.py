"""Instruments (lioncub.instruments) against values computed by hand, and the live
versions on a real 4-rank gloo group against the pure ones on the gathered inputs."""
import csv
import itertools
import json
import math

import pytest
import torch
import torch.distributed as dist

from tests.flat import LionCub
from lioncub import instruments as ins
from lioncub.harness import report
from tests.dist import run_workers


def _laplace(n, g):
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()


# ----------------------------------------------------------------------------- pure
def test_distribution_by_hand():
    d = ins.update_distribution(torch.tensor([-3.0, -1.0, 1.0, 3.0]), bins=4, span=2.0)
    # mean 0, var (9+1+1+9)/4 = 5, E[x^4] = (81+1+1+81)/4 = 41: kurtosis 41/25
    assert d["kurtosis"] == pytest.approx(41 / 25, rel=1e-12)
    assert d["mean_abs"] == 2.0 and d["max_abs"] == 3.0 and d["max_over_mean"] == 1.5
    assert d["hist_counts"] == [1, 1, 1, 1] and d["hist_edges"] == [-2, -1, 0, 1, 2]
    d = ins.update_distribution(torch.tensor([-3.0, -1.0, 1.0, 3.0]), bins=4, span=1.0)
    assert d["hist_counts"] == [1, 1, 0, 2]  # ±1.5 clipped into the end bins
    g = torch.Generator().manual_seed(7)
    assert ins.update_distribution(_laplace(200_000, g))["kurtosis"] == pytest.approx(6.0, abs=0.4)
    assert ins.update_distribution(torch.randn(200_000, generator=g))["kurtosis"] == pytest.approx(3.0, abs=0.1)
    with pytest.raises(ValueError, match="bins must be"):
        ins.update_distribution(torch.ones(3), bins=0)


def test_tie_rate_by_hand():
    # every one of the 16 sign patterns of 4 workers once: C(4,2) = 6 of them tie
    pats = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=4)))  # (16, 4)
    assert ins.tie_rate(list(pats.T)) == 6 / 16
    assert ins.tie_rate([torch.tensor([1.0, 0.0, 2.0]), torch.tensor([-1.0, 0.0, 1.0])]) == 2 / 3


def test_sign_match_by_hand():
    cs = [torch.tensor([3.0, 1.0, -1.0, 0.5]), torch.tensor([-1.0, -1.0, -1.0, 0.5]),
          torch.tensor([-1.0, 2.0, 1.0, 0.5])]
    # exact sums [1, 2, -1, 1.5] -> [+, +, -, +]; sign votes [-1, 1, -1, 3] -> [-, +, -, +]
    rows = ins.sign_match(cs, quantizers=("sign",), votes=({"method": "sign_allreduce"},))
    for r in rows:
        assert (r["match"], r["flip"], r["zero"]) == (0.75, 0.25, 0.0)
    assert rows[0]["kept"] == 1.0 and rows[1]["name"] == "vote:sign_allreduce"
    rows = ins.sign_match([torch.tensor([1.0, 2.0]), torch.tensor([-3.0, -1.0])], quantizers=("sign",), votes=())
    assert (rows[0]["match"], rows[0]["zero"]) == (0.0, 1.0)  # exact [-, +]; signs cancel: u = 0
    # c = 0 on every worker: exact vote 0; a 1-bit wire sends +1 at even steps (spurious)
    cs = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])]
    row = ins.sign_match(cs, quantizers=(), votes=({"method": "onebit"},), step=0)[0]
    assert (row["match"], row["spurious"]) == (0.5, 0.5)


def test_l1_keeps_far_more_signs_than_linf_on_laplace():
    g = torch.Generator().manual_seed(1234)
    cs = [_laplace(20_000, g) for _ in range(4)]
    rows = {r["name"]: r for r in ins.sign_match(cs, quantizers=("l1", "linf"), bits=(2, 4), votes=(), seed=5)}
    # Laplace: Q1 at 2 bits keeps |x| >= mean/2, i.e. e^-0.5 = 0.61 of signs; Qinf keeps
    # |x|/max|x| of them on average, about 1/ln(n) ~ 0.1
    assert rows["l1-2bit"]["kept"] == pytest.approx(math.exp(-0.5), abs=0.02)
    assert rows["linf-2bit"]["kept"] < 0.15
    assert rows["l1-4bit"]["kept"] > 0.9 > 0.6 > rows["linf-4bit"]["kept"]
    assert rows["l1-2bit"]["match"] > 2 * rows["linf-2bit"]["match"]
    assert rows["linf-2bit"]["zero"] > 0.5 > 0.3 > rows["l1-2bit"]["zero"]
    assert rows["l1-4bit"]["match"] > rows["linf-4bit"]["match"] + 0.08
    for r in rows.values():
        assert r["match"] + r["flip"] + r["zero"] == pytest.approx(1.0) and r["spurious"] == 0.0


def test_momentum_std_by_hand():
    ms = [r * torch.arange(4.0) for r in range(4)]  # element j: values j*{0,1,2,3}, std j*sqrt(1.25)
    s = ins.momentum_std(ms)
    assert s["max_std"] == pytest.approx(3 * math.sqrt(1.25), rel=1e-12)
    assert s["rms_std"] == pytest.approx(math.sqrt(1.25 * (0 + 1 + 4 + 9) / 4), rel=1e-12)
    assert ins.momentum_std([torch.ones(3)] * 4)["max_std"] == 0.0


def test_outputs(tmp_path):
    g = torch.Generator().manual_seed(0)
    cs = [_laplace(2000, g) for _ in range(4)]
    rows = ins.sign_match(cs, bits=(4,))
    report.write_csv(rows, tmp_path / "m.csv")
    with open(tmp_path / "m.csv") as f:
        back = list(csv.DictReader(f))
    assert [r["name"] for r in back] == [r["name"] for r in rows]
    d = ins.update_distribution(cs[0])
    report.write_json({"d": d, "rows": rows}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["d"]["n"] == 2000
    report.plot_distribution(d, tmp_path / "d.png")
    report.plot_sign_match(rows, tmp_path / "s.png")
    report.plot_layers({"a": 1.0, "b": 2.0}, tmp_path / "l.png", ylabel="x", log=True)
    report.plot_series([1, 2], {"a": [0.1, 0.2]}, tmp_path / "t.png")
    for name in ("d", "s", "l", "t"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- live, 4 gloo ranks
class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(16))
        self.b = torch.nn.Parameter(torch.zeros(5))
        self.z = torch.nn.Parameter(torch.zeros(3))  # c = 0 on every rank: tied, but all zero


def _live(rank, world):
    model = _Two()
    opt = LionCub(model.parameters(), betas=(0.5, 0.99), vote="sign_allreduce", model=model)
    j = torch.arange(16)
    # a: no momentum; grad sign = bit `rank` of j, so the 16 coordinates hold all 16 patterns
    model.a.grad = torch.where((j >> rank) & 1 == 1, 1.0, -1.0)
    opt.state[model.b]["exp_avg"] = rank * torch.arange(5.0)  # std across ranks: j * sqrt(1.25)
    model.b.grad = torch.full((5,), 10.0)  # c_b > 0 everywhere: no ties
    model.z.grad = torch.zeros(3)
    cs = ins.update_vectors(opt)
    gathered = []
    for c in cs:
        out = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(out, c)
        gathered.append(torch.stack(out))
    everyone = [torch.cat([g[r] for g in gathered]) for r in range(world)]
    record = ins.analyze(opt, model, max_elements=1000)
    sampled = ins.live_sign_match(opt, max_elements=8, seed=3)
    return dict(record=json.loads(json.dumps(record)), sampled=sampled,
                pure_rows=ins.sign_match(everyone, step=opt.steps),
                pure_ties=ins.tie_rate(everyone), c_a=cs[0].tolist())


@pytest.fixture(scope="module")
def live():
    return run_workers(_live, 4)


def test_live_instruments_match_hand_and_pure_values(live):
    for r in live:
        rec = r["record"]
        assert rec["tie_rate"]["layers"] == {"a": 6 / 16, "b": 0.0, "z": 1.0}
        assert rec["tie_rate"]["all"] == 9 / 24 == r["pure_ties"]
        assert rec["tie_rate"]["all_zero"] == 3 / 24 and rec["tie_rate"]["ties_nonzero"] == 6 / 21
        std = rec["momentum_std"]
        assert std["a"]["max_std"] == 0.0
        assert std["b"]["max_std"] == pytest.approx(4 * math.sqrt(1.25), rel=1e-12)
        assert std["b"]["rms_mean"] == pytest.approx(1.5 * math.sqrt(sum(k * k for k in range(5)) / 5), rel=1e-12)
        assert rec["sign_match"] == r["pure_rows"]  # all 24 coordinates: the same computation
        assert rec["distribution"]["all"]["n"] == 24 and set(rec["distribution"]["layers"]) == {"a", "b", "z"}
        assert r["c_a"] == [0.5 * (1.0 if (k >> live.index(r)) & 1 else -1.0) for k in range(16)]
    assert all(r["sampled"] == live[0]["sampled"] for r in live)  # sampled alike on every rank
    assert all(r["record"]["sign_match"] == live[0]["record"]["sign_match"] for r in live)
