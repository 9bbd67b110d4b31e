"""SparseLoCo and DeMo (issue 16) on real 2-rank gloo groups: each method's defining identity.

SparseLoCo, every round: the residual plus what was sent equals ``β·e + Δ`` exactly (the
quantizer keeps each sent value within 2x of its entry, so the fp32 subtraction is exact);
the sent entries are a row's top-k by ``|e|`` and carry the documented 2-bit values; the
outer step equals a float64 mean of every rank's decoded message to within 2^-20·(1 + |θ|);
replicas are bit-identical after each round (and differ inside it); a run resumed from a
mid-round checkpoint is bit-identical to the uninterrupted one.

DeMo, every step: the momentum kept plus the inverse DCT of the components sent equals
``β·m + g`` to within 1e-5·max|m| (fp32 transforms; the DCT is checked orthonormal to 1e-6
in fp32, 1e-12 in float64, and against a cosine written here); the update equals
``-lr·sign`` of the inverse DCT (float64, written here) of the mean of the gathered
components, bit for bit wherever that reference is not within 1e-4·max of zero; replicas
are bit-identical after every step; resume is bit-exact.

Both: the loss falls on a small regression problem; bad arguments fail in one line.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from lioncub import baselines
from lioncub.baselines.demo import DeMo, dct_matrix
from lioncub.baselines.sparseloco import SparseLoCo, decode
from lioncub.baselines.wire import Reader, rows
from tests.dist import run_workers

H = 3
SL = dict(H=H, k=8, chunk=256, beta=0.9, outer_lr=0.8)  # the 1200-element weight: 5 rows, the last one 176 long
DM = dict(k=4, chunk=16, beta=0.9, weight_decay=0.1)


class Tiny(torch.nn.Module):
    """A 40 -> 30 -> 1 regression net (odd sizes: partial chunks, one-element bias)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(40, 30), torch.nn.Linear(30, 1)

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x))).squeeze(-1)
        return out, ((out - y) ** 2).mean()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    w = torch.linspace(-1, 1, 40)
    x = torch.randn(32, 40, generator=g)
    return x, torch.sin(x @ w / 3)


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _same_everywhere(t: torch.Tensor) -> bool:
    a, b = _gather(t)
    return torch.equal(a, b)


def _train(method, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(method.backward(*_batch(rank, step)))
        method.step(1e-2)
    return losses


def _learns(name: str, lr: float, rank: int) -> tuple[float, float]:
    """Mean loss of the first and of the last 5 of 80 steps of the registered method."""
    losses = []
    m = baselines.build(name, Tiny(seed=0), lr=lr)
    for step in range(80):
        losses.append(m.backward(*_batch(rank, step)))
        m.step(lr)
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


# ------------------------------------------------------------------ SparseLoCo
def _sparseloco_round_checks(method, rank) -> dict:
    """The inner half of a round's last step by hand, then the outer step, checked against its definition."""
    out = dict(exact=True, topk=True, values=True, outer_err=0.0, sent=0)
    method.backward(*_batch(rank, method.steps))
    method.inner.step()
    method.inner.zero_grad(set_to_none=True)
    method.steps += 1
    e_prev = [e.clone() for e in method.error]
    start = [s.clone() for s in method.start]
    local = [p.detach().clone() for p in method.params]
    method.outer_step()
    reader = Reader(method.last_message)
    for e, e0, s, p, (n, c, k) in zip(method.error, e_prev, start, local, method.layout):
        acc = e0.mul(method.beta).add(s - p).reshape(-1)  # the same fp32 ops as the method
        sent = decode(reader, n, c, k)
        out["exact"] &= torch.equal(e.reshape(-1) + sent, acc)
        out["sent"] += int((sent != 0).sum())
        r, q = rows(acc, c), rows(sent, c)
        top = r.abs().topk(k, dim=1).values
        scale = top[:, :1]
        # every sent entry is among its row's k largest |acc|, and every top-k entry >= s/4 is sent
        out["topk"] &= bool((r.abs()[q != 0] >= top[:, -1:].expand_as(r)[q != 0]).all())
        out["topk"] &= torch.equal((q != 0).sum(1), ((top >= scale / 4) & (scale > 0)).sum(1))
        level = torch.where(r.abs() >= 0.75 * scale, scale, scale / 2) * r.sign()
        out["values"] &= torch.equal(q[q != 0], level[q != 0])
    # the outer step against a float64 mean of every rank's decoded message
    readers = [Reader(m) for m in _gather(method.last_message)]
    for p, s, (n, c, k) in zip(method.params, start, method.layout):
        mean = sum(decode(rd, n, c, k).double() for rd in readers) / len(readers)
        ref = s.reshape(-1).double() - method.outer_lr * mean
        err = ((p.detach().reshape(-1).double() - ref).abs() / (1 + ref.abs())).max()
        out["outer_err"] = max(out["outer_err"], float(err))
    return out


def _sparseloco_all(rank, world):
    res = {}
    model = Tiny(seed=rank)  # a different init per rank: the method must start them equal
    method = SparseLoCo(model, lr=1e-2, **SL)
    res["start_same"] = _same_everywhere(_flat(model))
    rounds, drift = [], []
    for _ in range(3):
        _train(method, rank, range(method.steps, method.steps + H - 1))
        drift.append(not _same_everywhere(_flat(model)))
        rounds.append(_sparseloco_round_checks(method, rank))
        rounds[-1]["same"] = _same_everywhere(_flat(model))
    res["rounds"], res["drift"] = rounds, drift
    nrows = [math.ceil(n / c) for n, c, _ in method.layout]
    res["bytes"] = (method.sent_bytes, 3 * sum(r * (4 + 2 * k) + math.ceil(r * k / 4)
                                               for r, (_, _, k) in zip(nrows, method.layout)))

    # resume mid-round (step 7 of H=3: one step into round 3): bit-identical to the uninterrupted run
    a = SparseLoCo(Tiny(seed=0), lr=1e-2, **SL)
    _train(a, rank, range(7))
    saved = copy.deepcopy(a.state_dict())
    _train(a, rank, range(7, 13))
    b = SparseLoCo(Tiny(seed=5), lr=1e-2, **SL)
    b.load_state_dict(saved)  # restores this rank's own mid-round parameters too
    _train(b, rank, range(7, 13))
    res["resume"] = (torch.equal(_flat(a.module), _flat(b.module)) and a.steps == b.steps == 13
                     and all(torch.equal(x, y) for x, y in zip(a.error, b.error)))
    try:
        SparseLoCo(Tiny(seed=0), lr=1e-2, **{**SL, "k": 4}).load_state_dict(saved)
    except ValueError as exc:
        res["config_error"] = str(exc)

    res["losses"] = _learns("sparseloco-h10", 1e-2, rank)  # the registered defaults (H=10)
    return res


@pytest.fixture(scope="module")
def sparseloco():
    return run_workers(_sparseloco_all, 2, timeout_s=60)


def test_sparseloco_residual_plus_sent_is_the_accumulated_delta_exactly(sparseloco):
    for res in sparseloco:
        assert all(r["exact"] for r in res["rounds"])
        assert all(r["sent"] > 0 for r in res["rounds"]), "nothing was sent: the identity would be vacuous"


def test_sparseloco_sends_each_rows_top_k_with_the_documented_2bit_values(sparseloco):
    for res in sparseloco:
        assert all(r["topk"] for r in res["rounds"])
        assert all(r["values"] for r in res["rounds"])


def test_sparseloco_outer_step_is_the_mean_of_the_decoded_messages(sparseloco):
    for res in sparseloco:
        assert all(r["outer_err"] <= 2 ** -20 for r in res["rounds"]), [r["outer_err"] for r in res["rounds"]]


def test_sparseloco_replicas_identical_after_each_round_and_apart_inside_it(sparseloco):
    res = sparseloco[0]
    assert res["start_same"]
    assert all(r["same"] for r in res["rounds"])
    assert all(res["drift"]), "replicas identical inside a round: the ranks are not training locally"


def test_sparseloco_resume_mid_round_is_bit_exact(sparseloco):
    for res in sparseloco:
        assert res["resume"]
        assert res["config_error"] == "checkpoint was saved with k=8 but this run has k=4"


def test_sparseloco_quantizer_on_heavy_tails_drops_small_entries_and_stays_exact():
    # no dist needed: rows with outliers (x = z^5), so that top-k entries below s/4 exist and are
    # kept in the residual, and both levels occur; residual + sent == x exactly all the same
    from lioncub.baselines.sparseloco import encode
    from lioncub.baselines.wire import Packer

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)) ** 5
    packer = Packer()
    sent = encode(x, 500, 40, packer)
    assert torch.equal((x - sent) + sent, x)
    assert torch.equal(decode(Reader(packer.message()), x.numel(), 500, 40), sent)
    r, q = rows(x, 500), rows(sent, 500)
    scale = r.abs().max(1, keepdim=True).values
    assert 0 < int((q != 0).sum()) < 20 * 40, "some top-k entries must fall below s/4"
    assert bool(((q != 0) == ((r.abs() >= r.abs().topk(40, 1).values[:, -1:]) & (r.abs() >= scale / 4))).all())
    assert {float(v) for v in (q.abs() / scale)[q != 0]} == {0.5, 1.0}


# ------------------------------------------------------------------ DeMo
def _dct64(c: int) -> torch.Tensor:
    """The orthonormal DCT-II, written out element by element (independent of dct_matrix)."""
    d = torch.empty(c, c, dtype=torch.float64)
    for j in range(c):
        for t in range(c):
            d[j, t] = math.cos(math.pi * (t + 0.5) * j / c) * math.sqrt((1 if j == 0 else 2) / c)
    return d


def _read_components(reader, n, chunk, k):
    nrows = math.ceil(n / chunk)
    val = reader.take(torch.float32, nrows * k).view(nrows, k).double()
    idx = reader.take(torch.uint8, nrows * k).view(nrows, k).long()
    return torch.zeros(nrows, chunk, dtype=torch.float64).scatter_(1, idx, val)


def _demo_step_checks(method, rank, d64) -> dict:
    lr, c = 1e-2, method.chunk
    method.backward(*_batch(rank, method.steps))
    m_prev = [m.clone() for m in method.momentum]
    grads = [p.grad.clone() for p in method.params]
    p_prev = [p.detach().clone() for p in method.params]
    method.step(lr)
    out = dict(recon=0.0, topk=True, update=True, masked=0, total=0)
    mine, everyone = Reader(method.last_message), [Reader(m) for m in _gather(method.last_message)]
    for p, p0, m, m0, g in zip(method.params, p_prev, method.momentum, m_prev, grads):
        n = p.numel()
        acc = m0.mul(method.beta).add(g).reshape(-1)
        sent = _read_components(mine, n, c, method.k)
        transmitted = (sent @ d64).reshape(-1)[:n]
        scale = float(acc.abs().max())
        out["recon"] = max(out["recon"], float((m.reshape(-1).double() + transmitted - acc.double()).abs().max()) / scale)
        coef = rows(acc.double(), c) @ d64.T
        chosen = sent != 0
        kth = coef.abs().topk(method.k, dim=1).values[:, -1:]
        out["topk"] &= bool((coef.abs()[chosen] >= (kth.expand_as(coef)[chosen] - 1e-5 * scale)).all())
        out["topk"] &= bool(((sent - coef).abs()[chosen] <= 1e-5 * scale).all())
        mean = sum(_read_components(rd, n, c, method.k) for rd in everyone) / len(everyone)
        ref = (mean @ d64).reshape(-1)[:n]
        clear = ref.abs() > 1e-4 * ref.abs().max()
        expected = p0.reshape(-1).mul(1 - lr * method.weight_decay).add(ref.sign().float(), alpha=-lr)
        out["update"] &= torch.equal(p.detach().reshape(-1)[clear], expected[clear])
        out["masked"] += int((~clear).sum())
        out["total"] += n
    out["same"] = _same_everywhere(_flat(method.module))
    return out


def _demo_all(rank, world):
    res = {}
    d32, d64 = dct_matrix(16), _dct64(16)
    res["dct"] = (float((d32 @ d32.T - torch.eye(16)).abs().max()),
                  float((dct_matrix(16, torch.float64) @ dct_matrix(16, torch.float64).T - torch.eye(16)).abs().max()),
                  float((dct_matrix(16, torch.float64) - d64).abs().max()))
    model = Tiny(seed=rank)
    method = DeMo(model, lr=1e-2, **DM)
    res["start_same"] = _same_everywhere(_flat(model))
    before = _flat(model)
    res["steps"] = [_demo_step_checks(method, rank, d64) for _ in range(4)]
    res["moved"] = not torch.equal(before, _flat(model))
    nrows = sum(math.ceil(p.numel() / 16) for p in model.parameters())
    res["bytes"] = (method.sent_bytes, 4 * nrows * 4 * (4 + 1))

    a = DeMo(Tiny(seed=0), lr=1e-2, **DM)
    _train(a, rank, range(3))
    saved, weights = copy.deepcopy(a.state_dict()), copy.deepcopy(a.module.state_dict())
    _train(a, rank, range(3, 7))
    b_model = Tiny(seed=5)
    b = DeMo(b_model, lr=1e-2, **DM)
    b_model.load_state_dict(weights)  # DeMo's replicas agree: any rank's model checkpoint will do
    b.load_state_dict(saved)
    _train(b, rank, range(3, 7))
    res["resume"] = (torch.equal(_flat(a.module), _flat(b.module)) and a.steps == b.steps == 7
                     and all(torch.equal(x, y) for x, y in zip(a.momentum, b.momentum)))

    res["losses"] = _learns("demo", 3e-3, rank)
    return res


@pytest.fixture(scope="module")
def demo():
    return run_workers(_demo_all, 2, timeout_s=60)


def test_demo_dct_is_orthonormal(demo):
    fp32, fp64, formula = demo[0]["dct"]
    assert fp32 <= 1e-6 and fp64 <= 1e-12 and formula <= 1e-12


def test_demo_kept_plus_transmitted_components_reconstruct_the_momentum(demo):
    for res in demo:
        assert all(s["recon"] <= 1e-5 for s in res["steps"]), [s["recon"] for s in res["steps"]]
        assert all(s["topk"] for s in res["steps"])


def test_demo_update_is_the_sign_of_the_mean_of_the_gathered_components(demo):
    for res in demo:
        assert res["moved"]
        for s in res["steps"]:
            assert s["update"]
            assert s["masked"] <= 0.01 * s["total"], "the reference was too close to zero too often"


def test_demo_replicas_identical_after_every_step_and_resume_is_bit_exact(demo):
    assert demo[0]["start_same"]
    for res in demo:
        assert all(s["same"] for s in res["steps"])
        assert res["resume"]


@pytest.mark.parametrize("peer", ["sparseloco", "demo"])
def test_wire_bytes_match_the_documented_layout_and_the_loss_halves(peer, request):
    for res in request.getfixturevalue(peer):
        sent, expected = res["bytes"]
        assert sent == expected
        first, last = res["losses"]
        assert last < 0.5 * first, res["losses"]


# ------------------------------------------------------------------ names and arguments
def test_names_build_the_peers_with_their_families():
    s = baselines.build("sparseloco-h50", Tiny(0), lr=1e-3)
    assert isinstance(s, SparseLoCo) and (s.H, s.k, s.chunk, s.beta, s.outer_lr) == (50, 64, 4096, 0.95, 1.0)
    assert baselines.family("sparseloco-h10") == "adamw"
    d = baselines.build("demo", Tiny(0), lr=1e-4)
    assert isinstance(d, DeMo) and (d.k, d.chunk, d.beta) == (4, 64, 0.999) and d.family == "lion"


@pytest.mark.parametrize("make, message", [
    (lambda m: SparseLoCo(m, lr=1e-3, H=0), r"H \(steps between synchronisations\) must be an int >= 1, got 0"),
    (lambda m: SparseLoCo(m, lr=1e-3, H=5, k=0), r"k \(entries sent per row of chunk elements\) must be an int in \[1, 4096\], got 0"),
    (lambda m: SparseLoCo(m, lr=1e-3, H=5, chunk=40000), r"chunk \(.*\) must be an int in \[1, 32767\], got 40000"),
    (lambda m: SparseLoCo(m, lr=1e-3, H=5, beta=1.5), r"beta \(error-feedback decay\) must be a number in \[0.0, 1.0\], got 1.5"),
    (lambda m: SparseLoCo(m, lr=1e-3, H=5, outer_lr=0), r"outer_lr \(outer step size\) must be a number in \(0.0, inf\), got 0"),
    (lambda m: DeMo(m, lr=1e-3, k=65), r"k \(DCT components sent per chunk\) must be an int in \[1, 64\], got 65"),
    (lambda m: DeMo(m, lr=1e-3, chunk=300), r"chunk \(DCT length; indices travel as uint8\) must be an int in \[1, 256\], got 300"),
    (lambda m: DeMo(m, lr=1e-3, beta=-0.1), r"beta \(momentum decay\) must be a number in \[0.0, 1.0\], got -0.1"),
    (lambda m: DeMo(m, lr=1e-3, weight_decay=-1.0), r"weight_decay \(decoupled\) must be a number in \[0.0, inf\), got -1.0"),
])
def test_bad_arguments_fail_in_one_line_naming_the_argument(make, message):
    with pytest.raises(ValueError, match=message) as err:
        make(Tiny(0))
    assert "\n" not in str(err.value)
