"""LionCub and LocalCub on FSDP2 shards (2 replicas x 2 shards, real gloo ranks) against a reference that runs
none of the library's optimizer or vote code: the whole model, stepped by hand-written Lion and vote math.

The reference holds the model whole, once per replica. Replica r's gradient is the mean of its shard group's
ranks' batch gradients, computed here by a plain ``nn.Module`` (what FSDP2's reduce-scatter leaves each rank a
row chunk of). Every scale the docstrings take over a tensor is taken over a local shard: the parameter's FSDP2
row chunk (``torch.chunk``, uneven or empty). Every step, each rank's local shards must equal the reference's
chunks:

* LionCub, sign votes (docs/sharded.md, lioncub/votes): exactly. θ is stepped in fp32 as Lion's docstring says
  (``θ·(1 − η·λ)``, then ``− η·u``, each one fp32 rounding, ``η·u`` exact); the momenta and ``c`` are float64
  (only the sign of ``c`` reaches θ).
* LocalCub with the scatter mean (``vote='onebit', aggregate='mean', bits=4``, worker and owner residuals), inner
  SGD: rounds (``delay=0``), streaming rounds (``delay=1``) and streaming fragments (``delay=1, fragments=2``) on
  localcub's docstring's schedule, each shard's message (its fragment's local shards) a scatter mean of its own over
  its two replicas (:mod:`tests.scatter_ref`), in float64: within a hundredth of the smallest quantization unit the
  run used (a level taken differently anywhere is a whole unit off); the worker and owner residuals alike; and a
  run resumed from each rank's ``state_dict`` taken inside a round equals the uninterrupted one bit for bit."""
from __future__ import annotations

import copy

import torch

from tests.flat import LionCub, LocalCub
from tests.dist import run_workers
from tests.scatter_ref import owner_span, scatter_mean
from tests.test_sharded import _batch, _mesh, _model, _shard

R, S = 2, 2  # replicas x shards; rank = replica·S + shard
LR, WD, BETA1, BETA2 = 0.02, 0.1, 0.9, 0.99


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s FSDP2 row chunks, one per shard: ``torch.chunk``'s views, and empty ones where it makes fewer."""
    parts = list(t.chunk(S, dim=0))
    return parts + [t[:0]] * (S - len(parts))


def _grads(theta: list[torch.Tensor], replica: int, step: int) -> list[torch.Tensor]:
    """Replica ``replica``'s gradient at ``theta`` (in ``theta``'s dtype): its shard group's ranks' mean (of two:
    exact in fp32 in any order, so FSDP2's reduce-scatter gives the same bits)."""
    model = _model().to(theta[0].dtype)
    with torch.no_grad():
        for p, x in zip(model.parameters(), theta):
            p.copy_(x)
    total = None
    for shard in range(S):
        model.zero_grad()
        x, y = (t.to(theta[0].dtype) for t in _batch(replica * S + shard, step))
        ((model(x) - y) ** 2).mean().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / S for g in total]


def _plus(v: torch.Tensor, parity: int) -> torch.Tensor:
    """The 1-bit vote of ``v``: v > 0, a zero up on even steps and down on odd ones."""
    return (v > 0) | ((v == 0) & (parity % 2 == 0))


def _vote(vote: str, vs: list[torch.Tensor], parity: int, server) -> torch.Tensor:
    """u of one tensor from the replicas' ``vs`` (float64): onebit, a tied count by the parity (or with a server
    residual ``server``: σ = sign(a + r), a = (2k − P)/P, r ← a + r − σ); pbit's binary lanes, a tie 0;
    sign_allreduce, sign(Σ sign(v))."""
    k = sum(_plus(v, parity).long() for v in vs)
    if vote == "sign_allreduce":
        return torch.sign(sum(torch.sign(v) for v in vs))
    if vote == "pbit":
        return torch.sign(2 * k - R).double()
    if server is not None:
        s = (2 * k - R).double() / R + server
        u = torch.where(_plus(s, parity), 1.0, -1.0).double()
        server.copy_(s - u)
        return u
    u = torch.sign(2 * k - R).double()
    return torch.where(u == 0, 1.0 if parity % 2 == 0 else -1.0, u)


def _lioncub_reference(vote: str, feedback: str, steps: int) -> list[list[torch.Tensor]]:
    """θ after every step (fp32, whole). ``vote='grad'``: Lion on the replicas' mean gradient (one momentum)."""
    theta = [p.detach().clone() for p in _model().parameters()]
    m = [[torch.zeros_like(x, dtype=torch.float64) for x in theta] for _ in range(R)]
    e = [[torch.zeros_like(x, dtype=torch.float64) for x in theta] for _ in range(R)]
    server = [torch.zeros_like(x, dtype=torch.float64) for x in theta] if feedback == "server" else None
    decay, lr = torch.tensor(1 - LR * WD, dtype=torch.float32), torch.tensor(LR, dtype=torch.float32)
    out = []
    for step in range(steps):
        g = [[x.double() for x in _grads(theta, r, step)] for r in range(R)]
        if vote == "grad":
            g = [[sum(xs) / R for xs in zip(*g)]] * R
            m = [m[0]] * R
        c = [[BETA1 * mi + (1 - BETA1) * gi for mi, gi in zip(m[r], g[r])] for r in range(R)]
        if feedback == "worker":  # v = c + e; e ← v − mean|v|·σ, the mean over each local shard
            for r in range(R):
                c[r] = [ci + ei for ci, ei in zip(c[r], e[r])]
                for ci, ei in zip(c[r], e[r]):
                    for v, res in zip(_rows(ci), _rows(ei)):
                        if v.numel():
                            res.copy_(v - v.abs().mean() * torch.where(_plus(v, step), 1.0, -1.0))
        for i in range(len(theta)):
            if vote == "grad":
                u = torch.sign(c[0][i])
            else:
                u = _vote(vote, [cr[i] for cr in c], step, None if server is None else server[i])
            theta[i] = theta[i] * decay - lr * u.float()
        m = [[BETA2 * mi + (1 - BETA2) * gi for mi, gi in zip(m[r], g[r])] for r in range(R)]
        out.append([x.clone() for x in theta])
    return out


def _lioncub_worker(rank, world, runs, steps):
    mesh = _mesh(R, S)
    out = {}
    for name, kw in runs:
        model = _shard(_model(), mesh["shard"])
        opt = LionCub(model.parameters(), lr=LR, weight_decay=WD, **kw)
        got = []
        for step in range(steps):
            x, y = _batch(rank, step)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            got.append([p.to_local().detach().clone() for p in model.parameters()])
        out[name] = got
    if rank == 0:  # (in a worker: one CPU thread, the sharded run's own matmuls)
        want = {name: _lioncub_reference(kw["vote"], kw.get("error_feedback", "none"), steps) for name, kw in runs}
        return out, want
    return out, None


LIONCUB_RUNS = [("onebit", dict(vote="onebit")), ("onebit_torch_ops", dict(vote="onebit", fused=False)),
                ("pbit", dict(vote="pbit")),
                ("sign_allreduce", dict(vote="sign_allreduce")), ("grad", dict(vote="grad")),
                ("onebit_worker_ef", dict(vote="onebit", error_feedback="worker")),
                ("onebit_server_ef", dict(vote="onebit", error_feedback="server"))]


def test_lioncub_on_shards_equals_hand_written_lion_and_votes():
    steps = 6
    results = run_workers(_lioncub_worker, R * S, LIONCUB_RUNS, steps)
    want = results[0][1]
    off = []  # (rank, run, step, which parameters' shards differ)
    for rank, (got, _) in enumerate(results):
        for name, trajectory in got.items():
            for step, params in enumerate(trajectory):
                differ = [i for i, (mine, whole) in enumerate(zip(params, want[name][step]))
                          if not torch.equal(mine, _rows(whole)[rank % S])]
                off += [(rank, name, step, differ)] if differ else []
    assert not off, "\n".join(map(str, off[:12]))


# ---------------------------------------------------------------------------------------------- LocalCub

def _fragments(sizes: list[int], parts: int) -> list[list[int]]:
    """The tensors (whole: these are far below a slice's 2^20 elements) of each of ``parts`` fragments of about
    equal size: fragment k ends at the tensor end nearest k·total/parts (the earlier of two as near)."""
    total, starts, ends = sum(sizes), [], []
    for n in sizes:
        starts.append(ends[-1] if ends else 0)
        ends.append(starts[-1] + n)
    cuts = [0]
    for k in range(1, parts):
        later = sorted({x for x in ends if cuts[-1] < x < total})
        cuts.append(min(later, key=lambda x: (abs(x - k * total / parts), x)))
    of = [max(k for k in range(parts) if cuts[k] <= start) for start in starts]
    return [[i for i in range(len(sizes)) if of[i] == k] for k in range(parts)]


class _LocalReference:
    """LocalCub on the whole model per replica, float64: inner SGD, the rounds of localcub's docstring (``outer='sgd'``,
    ``outer_lr`` 1, weight decay at the outer step), each shard's message its own scatter mean."""

    def __init__(self, bits: int, H: int, delay: int, fragments: int):
        self.bits, self.H, self.delay, self.F = bits, H, delay, fragments
        start = [p.detach().double() for p in _model().parameters()]
        self.start = start  # θ_s
        self.theta = [[x.clone() for x in start] for _ in range(R)]  # θ_i
        self.origin = [[x.clone() for x in start] for _ in range(R)]  # o_i
        self.e = [[torch.zeros_like(x) for x in start] for _ in range(R)]
        sizes = [[_rows(x)[s].numel() for x in start] for s in range(S)]
        self.parts = [_fragments(sizes[s], fragments) for s in range(S)]  # shard s: fragment k's tensors
        self.owners = {(s, k): [torch.zeros(owner_span(sum(sizes[s][i] for i in part), R, bits), dtype=torch.float64)
                                for _ in range(R)] for s in range(S) for k, part in enumerate(self.parts[s])}
        self.rounds, self.units, self.in_flight = 0, [], None

    def step(self, step: int) -> None:
        for r in range(R):  # H inner SGD steps per round, on each replica's own gradients (no weight decay)
            for x, g in zip(self.theta[r], _grads(self.theta[r], r, step)):
                x -= LR * g
        local = step % self.H + 1
        every = self.H // self.F
        if not self.delay and local == self.H:
            for s in range(S):
                self._outer(s, 0, self._send(s, 0))
            for r in range(R):
                self.theta[r] = [x.clone() for x in self.start]
            self.rounds += 1
        elif self.delay and local % every == 0:
            self._fragment_ends(local // every - 1)

    def _fragment_ends(self, j: int) -> None:
        """Receive the fragment in flight, then fragment j's Δ_i = θ_s − θ_i, o_i ← θ_i, and its scatter mean
        launched."""
        self.flush()
        ds = []
        for s in range(S):
            ds.append(self._send(s, j))
            for r in range(R):
                for i in self.parts[s][j]:
                    _rows(self.origin[r][i])[s].copy_(_rows(self.theta[r][i])[s])
        self.in_flight = (j, ds)

    def flush(self) -> None:
        """The fragment in flight received: over its tensors θ_s ← outer(θ_s, d), θ_i ← θ_s + θ_i − o_i (this
        replica's progress since the launch); a round is complete with its last fragment."""
        if self.in_flight is None:
            return
        k, ds = self.in_flight
        for s in range(S):
            self._outer(s, k, ds[s])
            for r in range(R):
                for i in self.parts[s][k]:
                    mine, began, start = (_rows(t[i])[s] for t in (self.theta[r], self.origin[r], self.start))
                    mine.copy_(start + (mine - began))
        if k == self.F - 1:
            self.rounds += 1
        self.in_flight = None

    def _send(self, s: int, k: int) -> torch.Tensor:
        """Shard s's fragment k: v_i = θ_s − θ_i + e_i over its tensors' local shards, their scatter mean (d, returned),
        e_i ← v_i − C(v_i)."""
        part = self.parts[s][k]
        vs = [torch.cat([(_rows(self.start[i])[s] - _rows(self.theta[r][i])[s] + _rows(self.e[r][i])[s]).reshape(-1)
                         for i in part]) for r in range(R)]
        sizes = [_rows(self.start[i])[s].numel() for i in part]
        d, sent, units = scatter_mean(vs, sizes, self.owners[(s, k)], self.bits, self.rounds % 2)
        self.units += units
        for r in range(R):
            for i, piece in zip(part, (vs[r] - sent[r]).split(sizes)):
                res = _rows(self.e[r][i])[s]
                res.copy_(piece.view(res.shape))
        return d

    def _outer(self, s: int, k: int, d: torch.Tensor) -> None:
        """θ_s ← θ_s·(1 − α·η·λ) − α·d over shard s's fragment k (α = 1)."""
        part = self.parts[s][k]
        for i, piece in zip(part, d.split([_rows(self.start[i])[s].numel() for i in part])):
            start = _rows(self.start[i])[s]
            start.copy_(start * (1 - LR * WD) - piece.view(start.shape))


def _sgd(groups) -> torch.optim.Optimizer:
    """The inner optimizer: plain SGD, so that Δ takes generic values (Lion's steps of ±η put Δ and its mean
    magnitude on one lattice, where v / unit lands on a rounding tie that fp32 and float64 may break apart)."""
    return torch.optim.SGD(groups)


def _local_steps(rank, model, opt, steps) -> list[list[torch.Tensor]]:
    """The steps ``steps`` (a range) of ``opt``; the local shards after each."""
    out = []
    for step in steps:
        x, y = _batch(rank, step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append([p.to_local().detach().clone() for p in model.parameters()])
    return out


def _flushed(model, opt) -> list[torch.Tensor]:
    """``delay=1``: the exchange in flight completed (its owner stage taken) and applied; the local shards then."""
    opt.flush()
    return [p.to_local().detach().clone() for p in model.parameters()]


def _localcub_worker(rank, world, runs, steps, save):
    mesh = _mesh(R, S)
    out, want = {}, {}

    def build(kw):
        model = _shard(_model(), mesh["shard"])
        return model, LocalCub(model.parameters(), lr=LR, weight_decay=WD, vote="onebit", aggregate="mean",
                               error_feedback=True, inner=_sgd, **kw)

    for name, kw in runs:
        model, opt = build(kw)
        got = _local_steps(rank, model, opt, range(save))
        own = copy.deepcopy((model.state_dict(), opt.state_dict()))  # inside a round (a fragment in flight)
        got += _local_steps(rank, model, opt, range(save, steps)) + [_flushed(model, opt)]
        residuals = [opt.state[p]["residual"].to_local().clone() for p in model.parameters()]
        owners = {k: v.clone() for k, v in opt.owner_residuals.items()}
        model2, opt2 = build(kw)  # each rank's own state dict, loaded: the same steps after it
        model2.load_state_dict(own[0])
        opt2.load_state_dict(own[1])
        resumed = _local_steps(rank, model2, opt2, range(save, steps)) + [_flushed(model2, opt2)]
        same = all(torch.equal(a, b) for x, y in zip(got[save:], resumed) for a, b in zip(x, y))
        out[name] = (got, residuals, owners, opt.rounds, same)
        if rank == 0:
            ref = _LocalReference(kw["bits"], kw["local_steps"], kw.get("delay", 0), kw.get("fragments", 1))
            trajectory = []
            for step in range(steps):
                ref.step(step)
                trajectory.append([[x.clone() for x in theta] for theta in ref.theta])
            ref.flush()
            trajectory.append([[x.clone() for x in theta] for theta in ref.theta])
            want[name] = (trajectory, ref.e, ref.owners, ref.rounds, min(ref.units))
    return out, want if rank == 0 else None


LOCAL_RUNS = [("scatter4", dict(bits=4, local_steps=2)),
              ("scatter4_streaming", dict(bits=4, local_steps=2, delay=1)),
              ("scatter4_fragments", dict(bits=4, local_steps=2, delay=1, fragments=2))]
# (Not 1 or 2 bits: with two replicas the owners' sums a = unit·(q_0 + q_1)/2 sit on a lattice of the unit, where
# a + r is exactly 0 or on a level's edge in one precision and a rounding away in the other.)


def _off(mine: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |mine − want| (0 for an empty shard)."""
    return float((mine.double() - want).abs().max()) if mine.numel() else 0.0


def test_localcub_scatter_mean_on_shards_equals_a_per_shard_float64_reference():
    steps = 8  # four rounds of H = 2; a per-rank state_dict taken after step 5, inside a round
    results = run_workers(_localcub_worker, R * S, LOCAL_RUNS, steps, 5)
    want = results[0][1]
    off = []  # (rank, run, what, its largest difference, the tolerance): every check that fails
    for rank, (got, _) in enumerate(results):
        replica, shard = divmod(rank, S)
        for name, (trajectory, residuals, owners, rounds, resumed) in got.items():
            ref_trajectory, ref_e, ref_owners, ref_rounds, unit = want[name]
            # fp32 against float64: a hundredth of the smallest unit any code took (a level taken differently is a
            # whole unit off), well above fp32's rounding of these values (below 1e-7 after 8 steps)
            tol = unit / 100
            assert tol > 2e-7, (name, unit)
            assert rounds == ref_rounds, (rank, name, rounds, ref_rounds)
            assert resumed, (rank, name)  # bit for bit: the run resumed from its own state dict
            fragments = dict(LOCAL_RUNS)[name].get("fragments", 1)
            assert sorted(owners) == list(range(fragments)), (rank, name, sorted(owners))
            checks = {f"theta after step {step}": max(_off(mine, _rows(whole)[shard]) for mine, whole in
                                                      zip(params, ref_trajectory[step][replica]))
                      for step, params in enumerate(trajectory)}  # (the last: after flush)
            checks["worker residuals"] = max(_off(mine, _rows(whole)[shard])
                                             for mine, whole in zip(residuals, ref_e[replica]))
            for k in range(fragments):  # this rank owns span `replica` of its shard's message of each fragment
                checks[f"owner residual {k}"] = _off(owners[k], ref_owners[(shard, k)][replica])
            off += [(rank, name, what, diff, tol) for what, diff in checks.items() if not diff <= tol]
    assert not off, "\n".join(map(str, off[:12]))
