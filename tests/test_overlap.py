"""Overlapped votes (LionCub(overlap=True)) on real gloo groups: the same parameters, bit
for bit, as votes after backward; gradient accumulation; missing gradients; votes really
launched during backward; hooks removed cleanly."""
import pytest
import torch
import torch.distributed as dist

from lioncub import LionCub
from lioncub.cost import predicted_bytes
from tests.dist import run_workers

VOTES = [dict(vote="pbit"), dict(vote="onebit"), dict(vote="gather"), dict(vote="sign_allreduce"),
         dict(vote="pbit", bits=8)]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.l1 = torch.nn.Linear(18, 16)
        self.l2 = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(4, 4)  # never gets a gradient
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.l1(self.emb(x).flatten(1)))
        return self.head(torch.tanh(self.l2(h)))


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, 13, (5, 3), generator=g), torch.randn(5, 3, generator=g)


def _loss(model, rank, step, micro=0):
    x, y = _batch(rank, step, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def _make(cfg, overlap, bucket_mb=300 * 4 / 2**20):
    torch.manual_seed(0)
    model = Net()
    opt = LionCub([{"params": [model.emb.weight], "lr": 0.02},
                   {"params": [p for n, p in model.named_parameters() if n != "emb.weight"],
                    "weight_decay": 0.1}],
                  lr=0.01, bucket_mb=bucket_mb, overlap=overlap, **cfg,
                  message_mb=1e-6)  # without overlap too, one message per bucket: same collectives
    return model, opt


def _train(cfg, overlap, rank, steps=4, micro=1, record=None):
    model, opt = _make(cfg, overlap)
    for step in range(steps):
        for m in range(micro):
            if m < micro - 1:
                with opt.no_sync():
                    _loss(model, rank, step, m).backward()
            else:
                _loss(model, rank, step, m).backward()
        if record is not None and overlap:
            record.append((len(opt.driver._pending), len(opt.buckets)))
        opt.step()
        if step < steps - 1:
            opt.zero_grad()  # the last step's gradients stay: the test reads which params had one
    return [p.detach().clone() for p in model.parameters()], opt


def _worker(rank, world, votes):
    out = {}
    for cfg in votes:
        ref, opt_ref = _train(cfg, False, rank)
        launched = []
        got, opt = _train(cfg, True, rank, record=launched)
        assert len(opt.buckets) >= 3, len(opt.buckets)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), cfg
        # from step 1 on (the unused layer learnt in step 0) backward launches every vote
        assert launched[0][0] < len(opt.buckets), launched
        assert all(k == n for k, n in launched[1:]), launched
        # overlap votes the unused layer's elements too (as zeros; its update is skipped):
        # exactly the model's bytes for full buckets minus those for the active elements
        params = [p for _, p in opt.param_entries]
        used = [p.grad is not None for p in params]
        assert used.count(False) == 2  # unused.weight, unused.bias

        def model_bytes(keep):
            out = {"bytes_sent": 0.0, "n_collectives": 0}
            for b in opt.buckets:
                n = sum(params[i].numel() for i in b.index if keep(i))
                pred = predicted_bytes(cfg["vote"], n, world, bits=cfg.get("bits"))
                out = {k: out[k] + pred[k] for k in out}
            return out

        full, active = model_bytes(lambda i: True), model_bytes(lambda i: used[i])
        extra = opt.last_step_stats.bytes_sent - opt_ref.last_step_stats.bytes_sent
        assert extra == pytest.approx(full["bytes_sent"] - active["bytes_sent"]) and extra > 0
        assert opt.last_step_stats.n_collectives - opt_ref.last_step_stats.n_collectives == \
            full["n_collectives"] - active["n_collectives"]
        out[cfg["vote"] + str(cfg.get("bits"))] = float(sum(p.sum() for p in got))
    # gradient accumulation: 3 micro-batches, votes only on the last backward
    ref, _ = _train(dict(vote="pbit"), False, rank, steps=3, micro=3)
    got, opt = _train(dict(vote="pbit"), True, rank, steps=3, micro=3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # a second backward without no_sync would be missed by the launched vote: refused
    model, opt = _make(dict(vote="pbit"), True)
    _loss(model, rank, 0).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model, rank, 1).backward()
    opt.driver.discard()
    opt.zero_grad()
    # remove_hooks: no hook fires any more, step() votes after backward, same parameters
    model, opt = _make(dict(vote="onebit"), True)
    model_ref, opt_ref = _make(dict(vote="onebit"), False)
    driver = opt.driver
    opt.remove_hooks()
    assert opt.driver is None and not driver._thread._thread.is_alive()
    for step in range(3):
        for mdl, o in ((model, opt), (model_ref, opt_ref)):
            _loss(mdl, rank, step).backward()
            o.step()
            o.zero_grad()
        assert not driver._pending
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_ref.parameters()))
    # replicas identical across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in got])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, e) for e in everyone)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_matches_votes_after_backward(world):
    res = run_workers(_worker, world, VOTES if world == 2 else VOTES[:2])
    assert all(r == res[0] for r in res)


def test_single_process_overlap_is_lion_and_validates():
    ref, _ = _train(dict(vote="pbit"), False, 0, steps=3)
    got, opt = _train(dict(vote="pbit"), True, 0, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    opt.remove_hooks()
    with pytest.raises(TypeError, match="overlap must be a bool"):
        _make(dict(vote="pbit"), "yes")
    with pytest.raises(ValueError, match="vote='grad'"):
        _make(dict(vote="grad"), True)
    _, opt = _make(dict(vote="pbit"), True)
    from lioncub.overlap import Overlap
    with pytest.raises(ValueError, match="already driven"):
        Overlap(opt)
    with pytest.raises(TypeError, match="must be a lioncub.LionCub"):
        Overlap(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    opt.remove_hooks()
