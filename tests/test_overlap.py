"""Overlapped votes (LionCub(overlap=True)) on real gloo groups: the same parameters, bit
for bit, as votes after backward; gradient accumulation; missing gradients; votes really
launched during backward; hooks removed cleanly; no host sync inside a backward hook, on
the CPU's vote-thread path and on the path CUDA takes (collectives issued from the hooks)."""
import contextlib
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lioncub import fused
from tests.flat import LionCub
from lioncub.engine import overlap as overlap_mod
from lioncub.comm import CommStats
from lioncub.engine.cost import predicted_bytes
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
        late_flag = 2 * (world - 1) / world  # one uint8 more in the step's agreement under a driver
        assert extra == pytest.approx(full["bytes_sent"] - active["bytes_sent"] + late_flag) and extra > late_flag
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


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
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
    from lioncub.engine.overlap import Overlap
    with pytest.raises(ValueError, match="already driven"):
        Overlap(opt)
    with pytest.raises(TypeError, match="must be a lioncub.LionCub"):
        Overlap(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    opt.remove_hooks()


# ---------------------------------------------------------------- host syncs inside backward
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "equal", "is_nonzero"}


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for the device, when they run inside
    backward (``torch._C._current_graph_task_id() != -1``: an autograd hook, a DDP comm hook):
    a read of a scalar (``aten._local_scalar_dense``: ``item``, ``bool``, ``int``, ``float``),
    a copy from a non-CPU tensor to the CPU (``.cpu()``, ``.tolist()``), and ops whose output
    size depends on the data. On CPU tensors a read of a scalar is still a dispatch call, so
    this counts the syncs a CUDA run would take. ``where``: the library frame of each."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._current_graph_task_id() != -1:
            name = func.__name__.split(".")[0]
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            to_cpu = (name == "_to_copy" and kwargs.get("device") is not None
                      and torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu") or (
                name == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu")
            if name == "_local_scalar_dense" or to_cpu or (name in _DATA_DEPENDENT and tensors):
                frames = [f for f in traceback.extract_stack() if "lioncub" in f.filename]
                last = frames[-1] if frames else None
                self.where.append(f"{name} at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} {last.name}"
                                  if last else name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_cuda_calls():
    """Any torch.cuda stream / event call inside fails: on CPU tensors the drivers make none."""
    names = ("current_stream", "Stream", "Event", "stream", "synchronize")
    saved = {n: getattr(torch.cuda, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("a torch.cuda call on the CPU path")
    try:
        for n in names:
            setattr(torch.cuda, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


def _counted(cfg, rank, threaded=True, steps=3):
    """Train with overlap=True under :class:`HostSyncs`; the CUDA path (exchanges issued from
    the hooks, no vote thread) when not ``threaded``. Returns (params, opt, syncs, launched)."""
    saved = overlap_mod.THREADED_DEVICES
    overlap_mod.THREADED_DEVICES = ("cpu",) if threaded else ()
    try:
        model, opt = _make(cfg, True)
    finally:
        overlap_mod.THREADED_DEVICES = saved
    assert (opt.driver._thread is not None) == threaded
    counter, launched = HostSyncs(), []
    with counter, no_cuda_calls():
        for step in range(steps):
            _loss(model, rank, step).backward()
            launched.append(len(opt.driver._pending))
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt, counter.where, launched


QUANTIZED = [dict(vote="pbit", bits=8, quantizer="l1"), dict(vote="pbit", bits=8, quantizer="linf")]


def _sync_worker(rank, world):
    for cfg in VOTES + QUANTIZED:
        ref, _ = _train(cfg, cfg.get("quantizer") is not None, rank, steps=3)
        for threaded in (True, False):
            got, opt, syncs, launched = _counted(cfg, rank, threaded)
            assert syncs == [], (cfg, threaded, syncs)  # no host sync inside a backward hook
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (cfg, threaded)
            if cfg.get("quantizer") is None or threaded:  # votes launched by backward
                assert launched[-1] == len(opt.buckets), (cfg, threaded, launched)
            else:  # an encode that reads its scale back waits for step() when there is no vote thread
                assert launched == [0] * len(launched), (cfg, launched)
            opt.remove_hooks()
    # the finite flag of the encodes, combined without a sync (the C loops: bools)
    model, opt = _make(dict(vote="pbit"), True)
    for bad in (False, True):
        loss = _loss(model, rank, 0)
        (loss * float("nan") if bad and rank == 1 else loss).backward()
        opt.driver.finish_votes(CommStats())
        flag = opt.driver.finite()
        if fused.status().startswith("in use"):
            assert flag is (not (bad and rank == 1)), (bad, flag)
        else:  # the torch ops do not check: step() does
            assert flag is None
        opt.driver.discard()
        opt.zero_grad()
    opt.remove_hooks()
    return True


def test_no_host_sync_inside_backward_hooks():
    """overlap=True: no hook reads a device value back to the host (counted with a dispatch
    mode during backward), on the vote-thread path (CPU) and on the CUDA path (collectives
    from the hooks, taken here on gloo), each bit-identical to votes after backward."""
    assert all(run_workers(_sync_worker, 2))


def test_finite_flags_combine_without_reading_them():
    """VoteDriver.finite's AND: bools short-circuit, 0-dim tensors combine on the device,
    one unchecked bucket (None) leaves the check to step()."""
    from lioncub.engine.guard import all_finite

    def and_(flags):
        return all_finite(*flags)
    assert and_([True, True]) is True and and_([True, False]) is False and and_([True, None]) is None
    t, f = torch.tensor(True), torch.tensor(False)
    with HostSyncs() as counter:  # (outside backward nothing is counted: check the type instead)
        out = and_([True, t, t])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() == 0 and bool(out)
    assert not bool(and_([t, f, True])) and and_([t, False]) is False and and_([f, None]) is None
    assert and_([None, False]) is False  # known non-finite: no need to check the rest
    assert counter.where == []


def _replica_groups_worker(rank, world, mode):
    """Two data-parallel groups side by side, [0, 2] and [1, 3] (as HSDP's replicas, or data parallelism
    beside tensor parallelism), each LionCub voting plainly, overlapping its votes, or under DDP's hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lioncub.ddp.hook import register

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both, in one order
    mine = groups[rank % 2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if mode == "ddp":
        model = DDP(model, process_group=mine, bucket_cap_mb=40 * 4 / 2**20)
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit", process_group=mine, overlap=mode == "overlap",
                  bucket_mb=40 * 4 / 2**20)
    if mode == "ddp":
        register(model, opt)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    names = [None] * world
    dist.all_gather_object(names, None if opt.driver is None else opt.driver.group.group_name)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return names, [torch.equal(everyone[r], everyone[(r + 2) % world]) for r in range(world)]


@pytest.mark.parametrize("mode", ["plain", "overlap", "ddp"])
def test_two_replica_groups_vote_apart_and_stay_identical(mode):
    """The votes' own group (overlap, the DDP hook) was made with the world's counter by the group's ranks
    only: both replica groups got one name (and one run in three hung in its first exchange). Made by its
    ranks, it is named by them."""
    names, same = run_workers(_replica_groups_worker, 4, mode, timeout_s=60)[0]
    if mode != "plain":
        assert names[0] == names[2] and names[1] == names[3] and names[0] != names[1], names
    assert all(same)


def _late_worker(rank, world):
    torch.manual_seed(0)
    first, middle, head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
    model = torch.nn.ModuleList([first, middle, head])
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit", overlap=True)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        use_first = not (rank == 1 and step == 1)  # rank 1 skips the first layer once, then uses it again
        head(middle(first(x) if use_first else x)).pow(2).mean().backward()  # the first layer's gradient comes last
        try:
            opt.step()
        except RuntimeError as exc:
            return step, str(exc)
        opt.zero_grad()
    return None


def test_a_gradient_after_its_vote_raises_on_every_rank_in_step():
    """Rank 1's first layer had no gradient on step 1, so on step 2 its bucket launched without waiting for it:
    that rank alone sees it arrive late. It used to raise inside backward on that rank only (the other rank then
    waited in its next collective until the timeout); now every rank raises in step(), from one agreement."""
    (step0, msg0), (step1, msg1) = run_workers(_late_worker, 2, timeout_s=20)
    assert step0 == step1 == 2
    assert re.match(r"overlap: parameter [01] got a gradient after its bucket's vote was launched", msg1), msg1
    assert msg0 == ("overlap: on 1 other rank(s) a parameter got its gradient after its bucket's vote was launched "
                    "(see that rank's error)"), msg0


def test_a_vote_launched_in_backward_is_timed_only_where_the_calls_block():
    from lioncub.comm import clock as comm_clock

    """On CPU (gloo blocks) a vote's times are real; elsewhere never: a clock read in backward would need a sync
    (or read a launch time into a step timed with timing=True)."""
    vote = overlap_mod._Vote([0, 1], torch.device("cpu"))
    assert vote.stats.sync is None  # timed, no sync needed
    for device in (torch.device("meta"), torch.device("cuda", 0)):
        vote = overlap_mod._Vote([0], device)
        assert vote.stats.sync is False  # every clock read is 0, no synchronize
        assert comm_clock(vote.stats) == 0.0  # (a synchronize of cuda:0 would raise on this host)
        timed_step = CommStats()
        timed_step.sync = device  # a step with timing=True
        timed_step.add(vote.stats)
        assert timed_step.t_collective == 0.0
