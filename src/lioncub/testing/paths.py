"""Every optimizer path, as a short run the device audit and ``make gpu-check`` share.

Each path is a function ``run(device, audit, steps)``: inside an initialised process group
(world size ≥ 2: the fake group of the CPU audit, or real ranks on a GPU), it builds a tiny
model on ``device``, the optimizer under test, and takes ``steps`` steps, labelling each
``opt.step()`` with ``audit.phase("step k")`` and each backward with ``"backward k"``. Every
rank runs the same function with the same arguments. ``PATHS`` maps a path's name to it;
``SYNC_BUDGET`` says how many host syncs a step may take (1 unless stated, with why).
"""
from __future__ import annotations

import functools
from ..optim.flags import flat_lioncub, flat_localcub, flat_nodecub
from typing import Callable

import torch
from torch import nn

__all__ = ["PATHS", "SYNC_BUDGET", "META_SKIP", "TinyLM", "NOT_PATH_CHANGING", "uncovered_options"]


class TinyLM(nn.Module):
    """Embedding → Linear → ReLU → Linear head: an input embedding and an output layer for
    ``momentum_sync='io'``, several buckets at ``bucket_mb=0.001``."""

    def __init__(self, vocab: int = 37, width: int = 13):  # odd sizes: partial bytes and words
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.embed(x))))


def _model(device) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(device)


def _backward(model, device, audit, k: int, *, scale: float = 1.0) -> None:
    x = torch.randint(0, 37, (4, 6), device=device)
    with audit.phase(f"backward {k}"):
        out = model(x)
        (out.float().square().mean() * scale).backward()


def _train(opt, model, device, audit, steps: int, *, bad_step: int = -1, first: int = 0) -> None:
    for k in range(first, first + steps):
        # a NaN loss at bad_step: every gradient non-finite, seen by backward's hooks too (overlap)
        _backward(model, device, audit, k, scale=float("nan") if k == bad_step else 1.0)
        with audit.phase(f"step {k}"):
            opt.step()
        opt.zero_grad(set_to_none=True)


def lioncub(device, audit, steps: int = 3, **kw) -> None:
    model = _model(device)
    opt = flat_lioncub(model.parameters(), lr=1e-3, bucket_mb=0.001, model=model, **kw)
    _train(opt, model, device, audit, steps)


def _drive_bad_step(audit, phase: str, flag_at: int = -1) -> None:
    """On ``meta`` (no values) make the agreement read in ``phase`` say one rank saw a NaN:
    LionCub's agreement is uint8 [ranks without a gradient per parameter, non-finite ranks(,
    replica flag on checking steps)(, a driver's late-gradient flag)]; on a real device the NaN
    itself drives it. ``flag_at``: the non-finite count's place from the end."""
    def drive(current, t):
        if current == phase and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() >= 2:
            out = torch.zeros(t.shape, dtype=t.dtype)
            out[flag_at] = 1  # (no replica check in these paths)
            return out
        return None
    audit.drive = drive


def lioncub_skip(device, audit, steps: int = 3, **kw) -> None:
    """nonfinite='skip_step' with a NaN gradient at step 1: the agreement's other branch."""
    model = _model(device)
    opt = flat_lioncub(model.parameters(), lr=1e-3, bucket_mb=0.001, nonfinite="skip_step", **kw)
    if device.type == "meta":
        _drive_bad_step(audit, "step 1", flag_at=-2 if kw.get("overlap") else -1)  # (a driver adds its flag)
    _train(opt, model, device, audit, steps, bad_step=1)
    assert opt.skipped_steps == 1, f"the NaN step was not skipped ({opt.skipped_steps} skipped)"


def _resume(make, device, audit, first: int, steps: int) -> None:
    """``make(model)``'s optimizer saved after ``first`` steps; a fresh one loads it (through a CPU copy, as a
    checkpoint loaded with map_location='cpu' is) and takes ``steps`` more."""
    model = _model(device)
    opt = make(model)
    _train(opt, model, device, audit, first)
    with audit.phase("save"):
        state = _to_cpu(opt.state_dict())
    opt2 = make(model)
    with audit.phase("load"):
        opt2.load_state_dict(state)
    _train(opt2, model, device, audit, steps, first=first)


def lioncub_resume(device, audit, steps: int = 3, **kw) -> None:
    """LionCub saved after two steps, resumed (:func:`_resume`)."""
    _resume(lambda model: flat_lioncub(model.parameters(), lr=1e-3, bucket_mb=0.001, **kw), device, audit, 2, steps)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu") if obj.device.type != "meta" else torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def lioncub_scaler(device, audit, steps: int = 3, **kw) -> None:
    """fp16-style loss scaling: GradScaler.step(opt) unscales, and the step agrees on the skip."""
    model = _model(device)
    opt = flat_lioncub(model.parameters(), lr=1e-3, bucket_mb=0.001, **kw)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 4)
    for k in range(steps):
        x = torch.randint(0, 37, (4, 6), device=device)
        with audit.phase(f"backward {k}"):
            scaler.scale(model(x).float().square().mean()).backward()
        with audit.phase(f"step {k}"):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def ddp_hook(device, audit, steps: int = 3, vote: str = "pbit") -> None:
    from lioncub.ddp import hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module
    model = _model(device)
    check = ddp_module._verify_param_shape_across_processes
    if dist.get_backend() == "fake":  # DDP's own shape check reads gathered values the fake group never fills
        ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.001)
    finally:
        ddp_module._verify_param_shape_across_processes = check
    opt = flat_lioncub(model.parameters(), lr=1e-3, vote=vote, model=model)
    hook.register(ddp, opt)
    _train(opt, ddp, device, audit, steps)


def localcub(device, audit, steps: int = 4, **kw) -> None:
    model = _model(device)
    opt = flat_localcub(model.parameters(), lr=1e-3, local_steps=kw.pop("local_steps", 2), model=model, **kw)
    if kw.get("pace") == "timed":  # a clock of one tick a reading: every rank's round of the same steps, so the
        ticks = iter(range(1 << 30))  # path's fixed step count ends on a round's end everywhere (wall time may not)
        opt._clock = lambda: float(next(ticks))
    _train(opt, model, device, audit, steps)


def localcub_resume(device, audit, steps: int = 4, **kw) -> None:
    """LocalCub saved mid-round (with ``delay=1``, a round in flight), resumed (:func:`_resume`)."""
    _resume(lambda model: flat_localcub(model.parameters(), lr=1e-3, local_steps=2, **kw), device, audit, 3, steps)


def nodecub(device, audit, steps: int = 3, **kw) -> None:
    model = _model(device)
    from lioncub import node_groups

    layout = node_groups(local_size=1)
    opt = flat_nodecub(model.parameters(), lr=1e-3, layout=layout, model=model, **kw)
    _train(opt, model, device, audit, steps)


def baseline(device, audit, steps: int = 3, name: str = "demo") -> None:
    from lioncub.baselines import build

    class LM(TinyLM):  # the harness's (x, y) -> (logits, loss) interface
        def forward(self, x, y):
            logits = super().forward(x)
            return logits, logits.float().square().mean()

    torch.manual_seed(0)
    method = build(name, LM().to(device), lr=1e-3)
    for k in range(steps):
        x = torch.randint(0, 37, (4, 6), device=device)
        with audit.phase(f"backward {k}"):
            method.backward(x, x)
        with audit.phase(f"step {k}"):
            method.step(1e-3)


def lioncub_fsdp2(device, audit, steps: int = 3, optimizer: str = "LionCub", **kw) -> None:
    """LionCub on FSDP2-style DTensor parameters (``Shard(0)`` on the 1-D shard mesh of a replicas x 1 mesh,
    local shards on ``device``): the local-shard views, the world's agreement, the state kept as DTensors
    and saved (loaded too off ``meta``). The gradients are set directly (no FSDP2 forward on ``meta``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu" if device.type == "meta" else device.type, (dist.get_world_size(), 1),
                            mesh_dim_names=("replicate", "shard"))["shard"]

    def dtensor(local):
        return DTensor.from_local(local, mesh, [Shard(0)], shape=local.shape, stride=local.stride(), run_check=False)

    model = _model(device)  # the DTensors share its parameters' storage: its replicas are compared after
    params = [nn.Parameter(dtensor(p.detach())) for p in model.parameters()]
    opt = {"LionCub": flat_lioncub, "LocalCub": flat_localcub}[optimizer](params, lr=1e-3, **kw)
    for k in range(steps):
        for p in params:
            p.grad = dtensor(torch.randn(p.shape).to(device))
        with audit.phase(f"step {k}"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        if k == 0:
            with audit.phase("save"):
                state = opt.state_dict()  # every replica's momenta, stacked on the 2-D mesh
            if device.type != "meta" and optimizer == "LionCub":  # (meta: no values to check; tests/test_sharded.py)
                opt.load_state_dict(state)


def _paths() -> dict[str, Callable]:
    p = functools.partial
    out: dict[str, Callable] = {}
    for vote in ("grad", "sign_allreduce", "gather", "onebit", "pbit"):
        out[f"lioncub {vote}"] = p(lioncub, vote=vote)
    out["lioncub grad bf16"] = p(lioncub, vote="grad", grad_dtype="bf16")
    for q in ("sign", "l1", "lp", "l0", "linf", "log"):
        out[f"lioncub pbit {q}"] = p(lioncub, vote="pbit", bits=8, quantizer=q)
    for vote in ("pbit", "onebit", "gather"):
        out[f"lioncub {vote} overlap"] = p(lioncub, vote=vote, overlap=True)
    out["lioncub pbit l1 overlap"] = p(lioncub, vote="pbit", bits=8, quantizer="l1", overlap=True)
    out["lioncub pbit linf overlap"] = p(lioncub, vote="pbit", bits=8, quantizer="linf", overlap=True)
    out["lioncub auto (given alpha, beta)"] = p(lioncub, vote="auto", alpha=1e-4, beta=1e-9)
    out["lioncub auto (calibrated)"] = p(lioncub, vote="auto")
    out["lioncub check_every"] = p(lioncub, vote="onebit", check_every=1)
    for sync in ("all", "io", "adaptive"):
        out[f"lioncub momentum_sync {sync}"] = p(lioncub, vote="pbit", momentum_sync=sync, sync_every=1)
    out["lioncub momentum_sync names"] = p(lioncub, vote="pbit", momentum_sync=["head.weight"], sync_every=1)
    out["lioncub nonfinite skip"] = lioncub_skip
    out["lioncub onebit overlap nonfinite skip"] = functools.partial(lioncub_skip, vote="onebit", overlap=True)
    out["lioncub state_dict/load"] = p(lioncub_resume, vote="pbit", quantizer="linf", bits=8)
    for vote in ("pbit", "onebit"):
        out[f"ddp hook {vote}"] = p(ddp_hook, vote=vote)
    for vote in ("grad", "sign_allreduce", "gather", "onebit", "pbit"):
        out[f"localcub {vote}"] = p(localcub, vote=vote)
    out["localcub pbit linf"] = p(localcub, vote="pbit", bits=8, quantizer="linf")
    out["localcub mean"] = p(localcub, vote="pbit", bits=8, quantizer="l1", aggregate="mean")
    out["localcub onebit ef nesterov"] = p(localcub, vote="onebit", error_feedback=True, outer="nesterov")
    # every option a user can set (uncovered_options / NOT_PATH_CHANGING below): the state-keeping variants
    out["lioncub onebit mean"] = p(lioncub, vote="onebit", aggregate="mean", mean_restart=2)
    out["lioncub onebit mean geometric"] = p(lioncub, vote="onebit", aggregate="mean", mean_norm="geometric",
                                             mean_adapt=1.5, mean_range=10.0, mean_restart=0)
    for ef in ("worker", "server", "both"):
        out[f"lioncub onebit error_feedback {ef}"] = p(lioncub, vote="onebit", error_feedback=ef)
    out["lioncub pbit stochastic_signs"] = p(lioncub, vote="pbit", stochastic_signs=True, seed=1)
    out["lioncub onebit tie hold"] = p(lioncub, vote="onebit", tie="hold")
    out["lioncub pbit unfused, small messages, bf16 sync"] = p(lioncub, vote="pbit", fused=False, message_mb=0.0005,
                                                              momentum_sync="all", sync_every=1,
                                                              sync_dtype="bf16")
    out["lioncub pbit untimed"] = p(lioncub, vote="pbit", timing=False)
    out["lioncub auto (given alpha, beta, gamma)"] = p(lioncub, vote="auto", alpha=1e-4, beta=1e-9,
                                                      gamma={"onebit": (1e-9, 0.0)})
    out["lioncub grad scaler"] = p(lioncub_scaler, vote="pbit")
    out["localcub lion inner, lion outer, tie minus"] = p(localcub, vote="onebit", inner="lion", outer="lion",
                                                         outer_lr=0.5, outer_betas=(0.9, 0.99), tie="minus")
    out["localcub sgd outer momentum"] = p(localcub, vote="grad", outer="sgd", outer_momentum=0.9)
    out["localcub scatter mean 2 bits"] = p(localcub, vote="onebit", aggregate="mean", bits=2, error_feedback=True)
    out["localcub local_steps auto"] = p(localcub, steps=12, local_steps="auto", round_share=0.5, min_local_steps=5,
                                         max_local_steps=20,
                                         alpha=1e-4, beta=1e-9, vote="pbit")
    out["localcub mean delay 1"] = p(localcub, vote="pbit", bits=8, quantizer="l1", aggregate="mean",
                                     error_feedback=True, delay=1)
    out["localcub scatter mean fragments"] = p(localcub, steps=8, local_steps=4, vote="onebit", aggregate="mean",
                                               bits=4, error_feedback=True, delay=1, fragments=2)
    out["localcub scatter mean fragments eager"] = p(localcub, steps=8, local_steps=4, vote="onebit", aggregate="mean",
                                                     bits=4, error_feedback=True, delay=1, fragments=2, eager=True,
                                                     outer="nesterov")
    # Options(pace='timed'): rounds of a time (each rank's steps gathered once a round, its Δ weighted by them)
    out["localcub timed scatter mean"] = p(localcub, steps=6, local_steps=2, vote="onebit", aggregate="mean", bits=2,
                                           error_feedback=True, pace="timed")
    out["localcub timed mean delay 1"] = p(localcub, steps=6, local_steps=2, vote="grad", delay=1, pace="timed")
    out["localcub auto skip check"] = p(localcub, vote="auto", alpha=1e-4, beta=1e-9, gamma={"pbit": (1e-9, 0.0)},
                                        nonfinite="skip", check_every=1)
    # the outer state on the host: every copy to and from it non_blocking, no collective on it (issue 68)
    out["localcub host state"] = p(localcub, vote="onebit", error_feedback=True, outer="nesterov", outer_state="host")
    out["localcub host state scatter mean fragments"] = p(localcub, steps=8, local_steps=4, vote="onebit",
                                                          aggregate="mean", bits=4, error_feedback=True, delay=1,
                                                          fragments=2, outer="lion", outer_state="host")
    out["localcub host state mean delay 1 skip check"] = p(localcub, vote="pbit", bits=8, quantizer="l1",
                                                           aggregate="mean", error_feedback=True, delay=1,
                                                           nonfinite="skip", check_every=1, outer="nesterov",
                                                           outer_state="host")
    out["localcub host state resume"] = p(localcub_resume, vote="onebit", aggregate="mean", bits=4,
                                          error_feedback=True, delay=1, outer="nesterov", outer_state="host")
    out["nodecub pbit"] = p(nodecub, vote="pbit")
    out["nodecub onebit"] = p(nodecub, vote="onebit")
    out["nodecub unsharded skip check, mean"] = p(nodecub, shard=False, nonfinite="skip", check_every=1,
                                                   vote="onebit", aggregate="mean")
    for ef in ("worker", "server"):
        out[f"nodecub onebit error_feedback {ef}"] = p(nodecub, vote="onebit", error_feedback=ef)
    out["nodecub pbit stochastic_signs"] = p(nodecub, vote="pbit", stochastic_signs=True)
    out["nodecub onebit tie hold"] = p(nodecub, vote="onebit", tie="hold")
    out["lioncub fsdp2 onebit"] = p(lioncub_fsdp2, vote="onebit", bucket_mb=0.001)
    out["lioncub fsdp2 pbit l1"] = p(lioncub_fsdp2, vote="pbit", bits=8, quantizer="l1", bucket_mb=0.001)
    out["localcub fsdp2 lane mean"] = p(lioncub_fsdp2, optimizer="LocalCub", local_steps=2, vote="pbit", bits=8,
                                        quantizer="l1", aggregate="mean", error_feedback=True, steps=4)
    out["localcub fsdp2 lane mean host state"] = p(lioncub_fsdp2, optimizer="LocalCub", local_steps=2, vote="pbit",
                                                   bits=8, quantizer="l1", aggregate="mean", error_feedback=True,
                                                   steps=4, outer_state="host")
    out["sparseloco"] = p(baseline, name="sparseloco-h10", steps=11)
    out["demo"] = p(baseline, name="demo")
    return out


PATHS: dict[str, Callable] = _paths()

SYNC_BUDGET: dict[str, int] = {name: 1 for name in PATHS}
"""Host syncs one step may take: LionCub's one agreement read. The exceptions, and why:"""
for _name in PATHS:
    if _name == "lioncub momentum_sync adaptive":
        SYNC_BUDGET[_name] = 2  # + the divergence estimate that chooses which momenta to average
    if _name.startswith("localcub"):
        SYNC_BUDGET[_name] = 2  # the inner step's NaN check (keeps it out of the inner state) + the round's read
    if _name.startswith("nodecub"):
        SYNC_BUDGET[_name] = 2  # the node mean's gradient presence, the world's agreement (its vote reads none)
    if _name == "nodecub unsharded skip check, mean":
        SYNC_BUDGET[_name] = 3  # + check_every=1's replica check on each step
    if _name in ("localcub auto skip check", "localcub host state mean delay 1 skip check"):
        SYNC_BUDGET[_name] = 3  # + check_every=1's replica check after each round
    if "timed" in _name:
        SYNC_BUDGET[_name] = 3  # + the round's gathered steps and step times (one read a round: who contributed)
    if _name == "localcub local_steps auto":
        SYNC_BUDGET[_name] = 3  # + once, at the first round's end, the slowest rank's timed iteration (the pick)

META_SKIP: dict[str, str] = {name: "DDP's C++ reducer cannot run on meta tensors (it crashes in backward); "
                             "the hook's launch/apply are the overlap driver's, audited there, and "
                             "make gpu-check runs this path on CUDA" for name in PATHS if name.startswith("ddp hook")}
"""Paths the meta audit cannot run, and why."""


# ---------------------------------------------------------------------- coverage of the options
_OPTIMIZER_OF = {lioncub: "LionCub", lioncub_skip: "LionCub", lioncub_resume: "LionCub", lioncub_scaler: "LionCub",
                 ddp_hook: "LionCub", localcub: "LocalCub", localcub_resume: "LocalCub", nodecub: "NodeCub"}
_SET_INSIDE = {lioncub: {"bucket_mb", "model"}, lioncub_skip: {"bucket_mb", "nonfinite"},
               lioncub_resume: {"bucket_mb"}, lioncub_scaler: {"bucket_mb"}, ddp_hook: {"model"},
               localcub: {"local_steps", "model"}, localcub_resume: {"local_steps"}, nodecub: {"layout", "model"}}
"""The options a path function passes its optimizer itself (beyond its keyword arguments)."""

NOT_PATH_CHANGING: dict[str, str] = {
    "params": "what is optimized, not how",
    "lr": "a number in the same arithmetic", "betas": "numbers in the same arithmetic",
    "weight_decay": "a number in the same arithmetic", "maximize": "a sign flip of the gradient, on the device",
    "outer_lr": "a number in the same arithmetic", "outer_momentum": "a number in the same arithmetic",
    "outer_betas": "numbers in the same arithmetic",
    "seed": "the generator's start, not where it lives (stochastic_signs' paths draw from it)",
    "process_group": "the audit's fake group is the world; a subgroup goes through the same collectives",
    "_verified": "internal: NodeCub's own LionCub skips a check NodeCub made",
}
"""Constructor options no audited path needs to set, and why: they change values, not which
collectives, devices or host reads a step uses."""


NODECUB_VOTE_OPTIONS = ("vote", "error_feedback", "stochastic_signs", "tie", "aggregate")
"""The options of NodeCub's cross-node LionCub (its ``**vote_args``) that keep state of their own or
change the vote's collectives: each needs a NodeCub path too."""


def uncovered_options() -> dict[str, set[str]]:
    """Per optimizer, the constructor options that no path of :data:`PATHS` sets and that are not
    in :data:`NOT_PATH_CHANGING` (and, under ``'NodeCub vote_args'``, the
    :data:`NODECUB_VOTE_OPTIONS` no NodeCub path sets): a new option must come with an audited path,
    or a reason here."""
    import inspect

    import lioncub as lc
    from ..optim.lioncub import configure

    # the engine's settings (the flat keys the aggregation objects and Options become: lioncub.optim.flags)
    named = {"LionCub": set(inspect.signature(configure).parameters) - {"self"},
             "LocalCub": set(inspect.signature(lc.LocalCub._configure).parameters) - {"self"}}
    named["NodeCub"] = {"params", "lr", "betas", "weight_decay", "layout", "shard", "nonfinite", "check_every", "model"}
    set_by: dict[str, set[str]] = {n: set() for n in named}
    vote_args: set[str] = set()
    for run in PATHS.values():
        fn, keywords = (run.func, set(run.keywords)) if isinstance(run, functools.partial) else (run, set())
        if fn not in _OPTIMIZER_OF:
            continue
        name = _OPTIMIZER_OF[fn]
        set_by[name] |= keywords | _SET_INSIDE[fn]
        if name == "NodeCub":
            vote_args |= keywords - named["NodeCub"]
    out = {n: named[n] - set_by[n] - set(NOT_PATH_CHANGING) for n in named}
    out["NodeCub vote_args"] = set(NODECUB_VOTE_OPTIONS) - vote_args
    return out
