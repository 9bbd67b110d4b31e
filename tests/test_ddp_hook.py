"""The DDP comm hook on real gloo groups: bit-identical to LionCub without DDP, gradient
accumulation with ddp.no_sync(), clear errors; and HF Trainer (skipped without transformers)."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.flat import LionCub
from lioncub.engine import overlap as overlap_mod
from lioncub.ddp.hook import register
from tests.dist import run_workers
from tests.test_overlap import HostSyncs, no_cuda_calls


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.l1 = torch.nn.Linear(18, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        h = torch.tanh(self.l1(self.emb(x).flatten(1)))
        return self.head(torch.tanh(self.l2(h)))


def _loss(model, rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x, y = torch.randint(0, 13, (5, 3), generator=g), torch.randn(5, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _pair(cfg):
    torch.manual_seed(0)
    plain = Net()
    opt = LionCub(plain.parameters(), lr=0.01, weight_decay=0.1, **cfg)
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=1500 * 4 / 2**20)  # several DDP buckets
    opt_ddp = LionCub(ddp.parameters(), lr=0.01, weight_decay=0.1, **cfg)
    return plain, opt, ddp, opt_ddp


def _ddp_worker(rank, world):
    for cfg in (dict(vote="pbit"), dict(vote="onebit"), dict(vote="sign_allreduce"), dict(vote="onebit", tie="minus")):
        plain, opt, ddp, opt_ddp = _pair(cfg)
        state = register(ddp, opt_ddp)
        for step in range(4):
            micro = 1 if step < 2 else 3  # steps 2-3 accumulate 3 micro-batches
            for m in range(micro):  # the plain run first: no two optimizers' collectives interleave
                _loss(plain, rank, step, m).backward()
            opt.step()
            for m in range(micro):
                if m < micro - 1:
                    with ddp.no_sync():
                        _loss(ddp, rank, step, m).backward()
                    assert not state._pending  # no vote launched inside no_sync
                else:
                    _loss(ddp, rank, step, m).backward()
            # one vote per DDP bucket, launched by backward (DDP's first step: one 1 MiB bucket)
            assert len(state._pending) >= (2 if step else 1), len(state._pending)
            opt_ddp.step()
            # no fp32 gradient all-reduce: only the votes and the agreement flag travel
            fp32_allreduce = 2 * (world - 1) / world * 4 * sum(p.numel() for p in ddp.parameters())
            assert opt_ddp.last_step_stats.bytes_sent < fp32_allreduce / 3  # int8 signs at most
            # p.grad still holds the local gradient (DDP wrote back the hook's unchanged buffer)
            for a, b in zip(plain.parameters(), ddp.module.parameters()):
                assert torch.equal(a.grad, b.grad)
            opt.zero_grad()
            opt_ddp.zero_grad()
            for a, b in zip(plain.parameters(), ddp.module.parameters()):
                assert torch.equal(a, b), (cfg, step)
        for a, b in zip(plain.parameters(), ddp.module.parameters()):  # local momenta, from local grads
            assert torch.equal(opt.state[a]["exp_avg"], opt_ddp.state[b]["exp_avg"])
    # errors
    _, _, ddp, opt_ddp = _pair(dict(vote="pbit"))
    register(ddp, opt_ddp)
    with pytest.raises(ValueError, match="already registered"):
        register(ddp, opt_ddp)
    _, _, ddp2, _ = _pair(dict(vote="pbit"))
    with pytest.raises(ValueError, match="already driven"):
        register(ddp2, opt_ddp)
    other = LionCub(Net().parameters(), lr=0.01)
    with pytest.raises(ValueError, match="does not hold 7 of the DDP model's 7"):
        register(ddp2, other)
    assert other.driver is None  # a refused registration leaves the optimizer as it was
    with pytest.raises(TypeError, match="ddp_model must be a DistributedDataParallel"):
        register(Net(), other)
    with pytest.raises(ValueError, match="vote='grad'"):
        register(ddp2, LionCub(ddp2.parameters(), lr=0.01, vote="grad"))
    return True


def test_ddp_hook_matches_standalone_lioncub():
    assert all(run_workers(_ddp_worker, 2))


def _ddp_run(cfg, rank, threaded, steps=3):
    """DDP + the hook under :class:`~tests.test_overlap.HostSyncs`; ``threaded=False``: the
    path CUDA takes (the votes' collectives issued from the comm hook, no vote thread)."""
    saved = overlap_mod.THREADED_DEVICES
    overlap_mod.THREADED_DEVICES = ("cpu",) if threaded else ()
    try:
        _, _, ddp, opt = _pair(cfg)
        state = register(ddp, opt)
    finally:
        overlap_mod.THREADED_DEVICES = saved
    assert (state._thread is not None) == threaded
    counter, launched = HostSyncs(), []
    with counter, no_cuda_calls():
        for step in range(steps):
            _loss(ddp, rank, step).backward()
            launched.append(len(state._pending))
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()], counter.where, launched


def _ddp_sync_worker(rank, world):
    for cfg in (dict(vote="pbit"), dict(vote="onebit"), dict(vote="gather"),
                dict(vote="pbit", bits=8, quantizer="l1")):
        quantized = cfg.get("quantizer") is not None
        if quantized:  # DDP's buckets are not LionCub's: per-bucket scales differ; threaded is the reference
            ref = _ddp_run(cfg, rank, True)[0]
        else:
            plain, opt, _, _ = _pair(cfg)
            for step in range(3):
                _loss(plain, rank, step).backward()
                opt.step()
                opt.zero_grad()
            ref = [p.detach().clone() for p in plain.parameters()]
        for threaded in (True, False):
            got, syncs, launched = _ddp_run(cfg, rank, threaded)
            assert syncs == [], (cfg, threaded, syncs)  # nothing in the comm hook waits for the device
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (cfg, threaded)
            # launched by DDP's hook during backward; without a vote thread an encode that reads
            # its scale back waits for step() (in DDP's bucket order)
            assert all(k == 0 for k in launched) if quantized and not threaded else all(k >= 1 for k in launched)
    return True


def test_ddp_hook_takes_no_host_sync_in_backward():
    """The comm hook reads nothing back from the device, on the CPU's vote-thread path and on
    the CUDA path (collectives from the hook, taken here on gloo), bit-identical to LionCub."""
    assert all(run_workers(_ddp_sync_worker, 2))


def _trainer_worker(rank, world, out_dir):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from lioncub.ddp.hook import attach_to_trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(cfg)  # built from a config: nothing downloaded
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (32, 16), generator=g)]
    opt = LionCub(model.parameters(), lr=1e-3, vote="pbit")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = TrainingArguments(output_dir=os.path.join(out_dir, str(rank)), per_device_train_batch_size=4,
                             max_steps=4, max_grad_norm=0.0, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
                             gradient_accumulation_steps=2, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    attach_to_trainer(trainer, opt)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert isinstance(trainer.model_wrapped, DDP) and opt.driver is not None
    assert opt.steps == 4 and opt.last_step_stats.n_collectives > 1
    n = sum(p.numel() for p in model.parameters())
    assert opt.last_step_stats.bytes_sent < n  # ~n/2 bytes of 4-bit lanes, not 4n of fp32
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, e) for e in everyone)  # replicas bit-identical
    bad = Trainer(model=GPT2LMHeadModel(cfg), args=TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[]),
                  train_dataset=data, optimizers=(opt, sched))
    with pytest.raises(ValueError, match="max_grad_norm"):
        attach_to_trainer(bad, opt)
    return True


@pytest.mark.slow  # ~13 s of transformers start-up
@pytest.mark.requires("transformers")  # tests/conftest.py: skipped without, failed under LIONCUB_REQUIRE
def test_hf_trainer_uses_the_hook(tmp_path):
    assert all(run_workers(_trainer_worker, 2, str(tmp_path)))


def _nodecub_worker(rank, world):
    from lioncub import node_groups
    from tests.flat import NodeCub

    torch.manual_seed(0)
    model = DDP(Net())
    opt = NodeCub(model.parameters(), lr=1e-3, layout=node_groups(1), vote="onebit")
    with pytest.raises(TypeError, match="drives a LionCub only.*NodeCub averages inside the node"):
        register(model, opt)
    return True


def test_ddp_hook_refuses_a_nodecub():
    """NodeCub runs its own in-node mean and cross-node vote; the DDP hook refuses it in one line."""
    assert all(run_workers(_nodecub_worker, 2))


_REFUSED = [  # what the DDP hook cannot carry: the option, and the words the refusal must say
    (dict(vote="onebit", aggregate="mean"), "aggregate='mean' updates its residuals"),
    (dict(vote="pbit", error_feedback="worker"), "error_feedback='worker'"),
    (dict(vote="onebit", error_feedback="worker"), "error_feedback='worker'"),
    (dict(vote="onebit", error_feedback="server"), "error_feedback='server' keeps the chunk owners' residuals"),
    (dict(vote="onebit", error_feedback="both"), "error_feedback='both'"),
    (dict(vote="pbit", stochastic_signs=True), "stochastic_signs=True"),
    (dict(vote="onebit", tie="hold"), "tie='hold' keeps the chunk owners' last votes"),
]


def _hook_refusals(rank, world):
    """Each option through the DDP comm hook itself (register(), not overlap=True): refused in one line
    naming the hook and the option, the optimizer left undriven and the DDP model without a hook (a
    valid registration then works); a GradScaler under the hook is refused at its step."""
    out = []
    for cfg, _ in _REFUSED:
        _, _, ddp, opt = _pair(cfg)
        try:
            register(ddp, opt)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
        assert opt.driver is None and getattr(ddp, "_lioncub_vote", None) is None
        register(ddp, LionCub(ddp.parameters(), lr=0.01, vote="pbit"))  # the model still takes a hook
    _, _, ddp, opt = _pair(dict(vote="pbit"))
    register(ddp, opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(ddp, rank, 0)).backward()
    try:
        scaler.step(opt)
        out.append(None)
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_the_ddp_hook_refuses_what_it_cannot_carry():
    for messages in run_workers(_hook_refusals, 2):
        for (cfg, words), msg in zip(_REFUSED, messages):
            assert msg is not None and "\n" not in msg, cfg
            assert msg.startswith("DDPVote ") and words in msg and "the DDP hook" in msg, (cfg, msg)
        assert messages[-1] is not None and "GradScaler" in messages[-1] and "DDP hook" in messages[-1]
