"""The 4-bit scatter mean (``vote='onebit', aggregate='mean', bits=4``) in 7 chunks, in rounds and streamed
(``delay=1``, whole rounds or ``fragments=2``, Nesterov), on 3 gloo ranks, against a float64 reference of LocalCub's
schedule written here from docs/local_steps.md and ScatterMean's docstring (:mod:`tests.test_round_scatter`'s
``_encode`` and ``_own``): every chunk's owner residuals its own, each tensor's unit from its whole (a fragment's part
of it) though it travels in slices. Every rank's bytes equal what ScatterMean.plan prices, beside the agreements'."""
from __future__ import annotations

import math

import pytest
import torch

from tests.flat import LocalCub
from tests.dist import run_workers
from tests.test_round_scatter import LEVEL, _agreement_bytes, _assert_close, _encode, _own, _planned_bytes, _span, _unit

SIZES = (40, 11, 6, 21, 3)
GAIN = (1.0, 1e-3, 1.0, 0.1, 1.0)  # the second tensor 1000x smaller: its unit must be its own
BITS, WORLD, BLOCK, CHUNK = 4, 3, 6, 20
PLAN = [[(0, 0, 18)], [(0, 18, 36)], [(0, 36, 40)], [(1, 0, 11), (2, 0, 6)], [(3, 0, 18)], [(3, 18, 21)], [(4, 0, 3)]]
"""The chunks at ``round_chunk`` = 20 and ``SCALE_BLOCK`` = 6, by plan_chunks' rule: whole tensors grouped up to 20
elements, one above in slices of 18 (20 cut down to the blocks). fragments=2 cuts at the place nearest half of the
81 elements (40, the first tensor's end): chunks 0-2 and 3-6. No owner holds a multiple of 4 elements of a tensor
(:func:`_owned`)."""
FRAGMENTS = {1: [range(0, 7)], 2: [range(0, 3), range(3, 7)]}
WHOLE = 100
"""A ``round_chunk`` above the model's 81 elements: no tensor cut, and with fragments=2 each fragment one chunk
(:data:`LAYOUTS`), the case where a fragment's end keeps the v it measured for its send."""
LAYOUTS = {CHUNK: (PLAN, FRAGMENTS),
           WHOLE: ([[(0, 0, 40)], [(1, 0, 11), (2, 0, 6), (3, 0, 21), (4, 0, 3)]], {2: [range(0, 1), range(1, 2)]})}
"""Each ``round_chunk`` tested: the chunks it cuts and each fragment count's chunks."""
START = [sum(SIZES[:i]) for i in range(len(SIZES))]


def _grads(rank: int, t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + rank)
    return [k * torch.randn(n, generator=g) for n, k in zip(SIZES, GAIN)]


def _owned(c: int, rank: int, plan=PLAN) -> torch.Tensor:
    """Rank ``rank``'s residual of its span of chunk ``c`` at the start, loaded as from a checkpoint: generic values
    at the tensors' scale (fp32; 0 on the padding). Why: x/unit' = 7·m·x_k / (4·Σ|x|) over the m elements of a tensor
    in a span. With r = 0 (a chunk's first exchange) it is a ratio of small integers, and an owner's new residual
    keeps Σ_k sign(x_k)·r_k = unit'·(7m/4 − Σ|w|), 0 where 4 divides m: both put x/unit' exactly on an edge between
    two levels (k + ½) in most data sets, where fp32 and float64 round apart. (The reference asserts the data keeps
    off the edges: EDGE.)"""
    gain = [GAIN[i] for i, lo, hi in plan[c] for _ in range(lo, hi)]
    span = _span(len(gain), WORLD, BITS)
    gain = torch.tensor(gain + [0.0] * (WORLD * span - len(gain)))
    return (gain * torch.randn(WORLD * span, generator=torch.Generator().manual_seed(c)))[rank * span:(rank + 1) * span]


def _worker(rank, world, kw, H, steps, slow=0.0, chunk=CHUNK):
    """Inner SGD at lr 1 from zeros (θ_i ← θ_i − g), rank 1 ``slow`` seconds behind at each step. At each fragment's
    end (each round's with ``delay=0``): θ_i, θ_s, e_i, the outer momentum and every chunk's owner residual, all
    settled there (the exchange in flight received; the fragment's own launched there, or with H/F > 1 at a later
    step); after ``flush()`` again. Every step's bytes and collectives."""
    import time

    from lioncub.optim import rounds

    rounds.SCALE_BLOCK = BLOCK  # (this worker process only)
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = LocalCub(ps, lr=1.0, local_steps=H, inner=lambda groups: torch.optim.SGD(groups), vote="onebit",
                   aggregate="mean", bits=BITS, error_feedback=True, **kw)
    opt.round_chunk = chunk
    sd = opt.state_dict()
    plan = LAYOUTS[chunk][0]
    sd["local"]["owner_residuals"] = {str(c): _owned(c, rank, plan) for c in range(len(plan))}
    opt.load_state_dict(sd)
    every = H // kw.get("fragments", 1)

    def flat(key):
        return torch.cat([(p if key is None else opt.state[p][key]).detach().reshape(-1) for p in ps])

    def snap():
        return dict(theta=flat(None), start=flat("start"), residual=flat("residual"),
                    momentum=flat("outer_m") if opt.outer == "nesterov" else None,
                    owners={c: r.clone() for c, r in opt.owner_residuals.items()})

    snaps, sent = [], []
    for t in range(1, steps + 1):
        for p, g in zip(ps, _grads(rank, t)):
            p.grad = g
        if rank == 1:
            time.sleep(slow)  # (the others' exchanges complete at other steps than its own)
        opt.step()
        sent.append((opt.last_step_stats.bytes_sent, opt.last_step_stats.n_collectives))
        if t % every == 0:
            snaps.append(snap())
    if opt.delay:
        opt.flush()
        sent.append((opt.last_round_stats.bytes_sent, opt.last_round_stats.n_collectives))
        snaps.append(snap())
    return dict(plan=[[tuple(pc) for pc in pieces] for pieces in opt._plan()], snaps=snaps, sent=sent,
                rounds=opt.rounds)


def _reference(H: int, F: int, steps: int, delay: int, alpha: float, mu: float, chunk: int = CHUNK):
    """LocalCub's schedule in float64 (docs/local_steps.md), every rank's, and each element's tensor's least unit.
    A round (``delay=0``) at every H-th step: Δ_i = θ_s − θ_i, the exchange of v_i = Δ_i + e_i, θ_s ← outer(θ_s, d),
    θ_i ← θ_s. Fragment j's end (``delay=1``, at steps (j+1)·H/F of a round; F = 1: the streaming round, its rebase
    the same rule): the fragment in flight received (θ_s ← outer(θ_s, d), θ_i ← θ_s + θ_i − o_i over it), o_i ← θ_i
    over j, and j's exchange of v_i = θ_s − o_i + e_i launched (e_i ← v_i − C(v_i)); its owners' half runs when it
    is received. Each tensor's unit_t from the ranks' mean |v_i| over its part of the fragment; each chunk its own
    message and owners' residuals. Outer: b ← μ·b + d, θ_s ← θ_s − α·(d + μ·b) (μ = 0: SGD). 4 bits: no level
    takes the round's parity."""
    n, (plan, fragments) = sum(SIZES), LAYOUTS[chunk]
    idx = [[START[i] + k for i, lo, hi in part for k in range(lo, hi)] for part in plan]
    tensor_of = [[i for i, lo, hi in part for _ in range(lo, hi)] for part in plan]
    theta, origin, e = ([torch.zeros(n, dtype=torch.float64) for _ in range(WORLD)] for _ in range(3))
    start, b = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    owners = {c: [_owned(c, j, plan).double() for j in range(WORLD)] for c in range(len(plan))}
    least = [math.inf] * len(SIZES)
    snaps, flight = [], None

    def launch(j: int) -> dict:
        """The workers' half of fragment j's exchange (every rank's e_i updated): each chunk's mean a."""
        v = [start - o + r for o, r in zip(origin, e)]  # (Δ_i = θ_s − θ_i, θ_i = o_i at the fragment's end)
        parts = {}
        for c in fragments[F][j]:
            for k, t in zip(idx[c], tensor_of[c]):
                parts.setdefault(t, []).append(k)
        units = {t: _unit(sum(float(x[ks].abs().mean()) for x in v) / WORLD, BITS) for t, ks in parts.items()}
        out = {}
        for c in fragments[F][j]:
            sent, out[c] = _encode([x[idx[c]] for x in v], tensor_of[c], units, BITS, 0)
            for i in range(WORLD):
                e[i][idx[c]] = v[i][idx[c]] - sent[i]
        for t, u in units.items():
            least[t] = min(least[t], u)
        return out

    def receive(means: dict) -> None:
        """The owners' half of each chunk's exchange, the outer step by its d, every rank's progress since the
        launch carried onto θ_s."""
        for c, a in means.items():
            ix = idx[c]
            d, owned = _own(a, tensor_of[c], owners[c], BITS, 0)
            for t, u in owned.items():
                least[t] = min(least[t], u)
            progress = [x[ix] - o[ix] for x, o in zip(theta, origin)]
            b[ix] = mu * b[ix] + d
            start[ix] -= alpha * (d + mu * b[ix])
            for x, moved in zip(theta, progress):
                x[ix] = start[ix] + moved

    def snap():
        snaps.append(dict(theta=[x.clone() for x in theta], start=start.clone(), residual=[x.clone() for x in e],
                          momentum=b.clone(), owners={c: [r.clone() for r in rs] for c, rs in owners.items()}))

    every = H // F
    late = delay and F > 1 and every > 1  # a fragment's exchange launched at a later step than its end
    for t in range(1, steps + 1):
        for i, x in enumerate(theta):
            x -= torch.cat(_grads(i, t)).double()
        if t % every:
            continue
        if flight is not None:
            receive(flight)
        j = (t - 1) % H // every
        frag = [k for c in fragments[F][j] for k in idx[c]]
        for x, o in zip(theta, origin):
            o[frag] = x[frag]
        if late:
            snap()
        flight = launch(j)
        if not delay:  # (θ_i = o_i: the outer step leaves θ_i = θ_s)
            receive(flight)
            flight = None
        if not late:
            snap()
    if delay:  # flush(): the last fragment launched (if it was not) and received
        receive(flight)
        snap()
    return snaps, torch.tensor([least[t] for t, n in enumerate(SIZES) for _ in range(n)], dtype=torch.float64)


def _check(got: list[dict], snaps: list[dict], least: torch.Tensor, plan=PLAN) -> None:
    """Every rank's snapshots against the reference's, element for element within LEVEL of the element's tensor's
    least unit (an owner's padding exactly 0); θ_s the same on every rank, bit for bit."""
    tol = LEVEL * least
    owned = {}  # each chunk's owner spans: the tolerance of the message's element there, 0 on the padding
    for c, chunk in enumerate(plan):
        part = torch.cat([tol[START[i] + lo:START[i] + hi] for i, lo, hi in chunk])
        span = _span(part.numel(), WORLD, BITS)
        part = torch.cat([part, torch.zeros(WORLD * span - part.numel(), dtype=torch.float64)])
        owned[c] = part.view(WORLD, span)
    for rank, mine in enumerate(got):
        assert mine["plan"] == plan and len(mine["snaps"]) == len(snaps)
        for at, (m, want) in enumerate(zip(mine["snaps"], snaps)):
            assert torch.equal(m["start"], got[0]["snaps"][at]["start"])
            _assert_close(m["theta"], want["theta"][rank], tol, ("θ_i", at, rank))
            _assert_close(m["start"], want["start"], tol, ("θ_s", at, rank))
            _assert_close(m["residual"], want["residual"][rank], tol, ("e_i", at, rank))
            if m["momentum"] is not None:
                _assert_close(m["momentum"], want["momentum"], tol, ("b", at, rank))
            assert sorted(m["owners"]) == sorted(want["owners"])
            for c, rs in want["owners"].items():
                _assert_close(m["owners"][c], rs[rank], owned[c][rank], ("owner residual of chunk", c, at, rank))


def _round_bytes(fragments: int, plan=PLAN) -> tuple[float, int]:
    """A round's bytes per rank and collectives: each fragment's agreement (a head for every parameter), and each
    chunk's exchange as ScatterMean.plan prices it (two collectives)."""
    chunks = [(sum(hi - lo for _, lo, hi in chunk), len(chunk)) for chunk in plan]
    return (fragments * _agreement_bytes(WORLD, len(SIZES)) + _planned_bytes(WORLD, BITS, chunks),
            fragments + 2 * len(plan))


def test_the_scatter_mean_in_chunks_equals_the_reference():
    """``delay=0``, 7 chunks (two tensors in slices, one chunk of two tensors), outer SGD at 1, H = 2, 3 rounds;
    each round's bytes on every rank."""
    H, steps = 2, 6
    got = run_workers(_worker, WORLD, dict(outer="sgd", outer_lr=1.0), H, steps)
    _check(got, *_reference(H, 1, steps, delay=0, alpha=1.0, mu=0.0))
    sent, calls = _round_bytes(1)
    for mine in got:
        for t, (b, n) in enumerate(mine["sent"], 1):
            assert (b, n) == ((pytest.approx(sent, rel=1e-12), calls) if t % H == 0 else (0, 0)), (t, b, n)


@pytest.mark.parametrize("F", [1, 2])
def test_the_scatter_mean_streamed_in_fragments_equals_the_reference(F):
    """``delay=1``, whole rounds (F = 1: each exchange received at the next round's end) or ``fragments=2`` (H = 4:
    each fragment's exchange launched after its end), 7 chunks, outer Nesterov (0.7, 0.9), 3 rounds and a flush, a
    rank 20 ms slower at each step (so the ranks take the all-gathers at different steps); the bytes of all of them
    on every rank, wherever a stage was launched. (Whole rounds once hung here: ranks issued the last round's
    all-gathers and the new all-to-alls in different orders. A short timeout: a hang fails in a minute.)"""
    H, steps = 4, 12
    kw = dict(outer="nesterov", outer_lr=0.7, outer_momentum=0.9, delay=1, fragments=F)
    got = run_workers(_worker, WORLD, kw, H, steps, 0.02, timeout_s=30)
    _check(got, *_reference(H, F, steps, delay=1, alpha=0.7, mu=0.9))
    sent, calls = _round_bytes(F)
    for mine in got:
        assert mine["rounds"] == 3
        assert sum(b for b, _ in mine["sent"]) == pytest.approx(3 * sent, rel=1e-12), mine["sent"]
        assert sum(n for _, n in mine["sent"]) == 3 * calls, mine["sent"]


def test_fragments_of_one_chunk_each_equal_the_reference():
    """``fragments=2`` with no tensor cut (``round_chunk`` above the model): each fragment is one chunk, whose end
    keeps the v_i = Δ_i + e_i it measured for the send a step later instead of making it again; with the 4-bit code's
    residuals e_i ≠ 0, a send of Δ_i alone (or of a stale v) departs from the reference's θ_s and e_i. H = 4, outer
    Nesterov (0.7, 0.9), 3 rounds and a flush, a rank 20 ms slower at each step."""
    H, steps = 4, 12
    kw = dict(outer="nesterov", outer_lr=0.7, outer_momentum=0.9, delay=1, fragments=2)
    got = run_workers(_worker, WORLD, kw, H, steps, 0.02, WHOLE, timeout_s=30)
    plan = LAYOUTS[WHOLE][0]
    _check(got, *_reference(H, 2, steps, delay=1, alpha=0.7, mu=0.9, chunk=WHOLE), plan=plan)
    sent, calls = _round_bytes(2, plan)
    for mine in got:
        assert mine["rounds"] == 3
        assert sum(b for b, _ in mine["sent"]) == pytest.approx(3 * sent, rel=1e-12), mine["sent"]
        assert sum(n for _, n in mine["sent"]) == 3 * calls, mine["sent"]
