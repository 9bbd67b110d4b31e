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
from typing import Callable

import torch
from torch import nn

__all__ = ["PATHS", "SYNC_BUDGET", "META_SKIP", "TinyLM"]


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
    import lioncub as lc
    model = _model(device)
    opt = lc.LionCub(model.parameters(), lr=1e-3, bucket_mb=0.001, model=model, **kw)
    _train(opt, model, device, audit, steps)


def _drive_bad_step(audit, phase: str) -> None:
    """On ``meta`` (no values) make the agreement read in ``phase`` say one rank saw a NaN:
    LionCub's agreement is uint8 [ranks without a gradient per parameter, non-finite ranks(,
    replica flag on checking steps)]; on a real device the NaN itself drives it."""
    def drive(current, t):
        if current == phase and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() >= 2:
            out = torch.zeros(t.shape, dtype=t.dtype)
            out[-1] = 1  # (no replica check in these paths: the flag is last)
            return out
        return None
    audit.drive = drive


def lioncub_skip(device, audit, steps: int = 3, **kw) -> None:
    """nonfinite='skip_step' with a NaN gradient at step 1: the agreement's other branch."""
    import lioncub as lc
    model = _model(device)
    opt = lc.LionCub(model.parameters(), lr=1e-3, bucket_mb=0.001, nonfinite="skip_step", **kw)
    if device.type == "meta":
        _drive_bad_step(audit, "step 1")
    _train(opt, model, device, audit, steps, bad_step=1)
    assert opt.skipped_steps == 1, f"the NaN step was not skipped ({opt.skipped_steps} skipped)"


def lioncub_resume(device, audit, steps: int = 3, **kw) -> None:
    """state_dict after two steps, a fresh optimizer loads it (through a CPU copy, as a
    checkpoint loaded with map_location='cpu' is), and steps on."""
    import lioncub as lc
    model = _model(device)
    opt = lc.LionCub(model.parameters(), lr=1e-3, bucket_mb=0.001, **kw)
    _train(opt, model, device, audit, 2)
    with audit.phase("save"):
        state = _to_cpu(opt.state_dict())
    opt2 = lc.LionCub(model.parameters(), lr=1e-3, bucket_mb=0.001, **kw)
    with audit.phase("load"):
        opt2.load_state_dict(state)
    _train(opt2, model, device, audit, steps, first=2)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu") if obj.device.type != "meta" else torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def ddp_hook(device, audit, steps: int = 3, vote: str = "pbit") -> None:
    import lioncub as lc
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
    opt = lc.LionCub(model.parameters(), lr=1e-3, vote=vote, model=model)
    hook.register(ddp, opt)
    _train(opt, ddp, device, audit, steps)


def localcub(device, audit, steps: int = 4, **kw) -> None:
    import lioncub as lc
    model = _model(device)
    opt = lc.LocalCub(model.parameters(), lr=1e-3, local_steps=2, model=model, **kw)
    _train(opt, model, device, audit, steps)


def nodecub(device, audit, steps: int = 3, **kw) -> None:
    import lioncub as lc
    model = _model(device)
    layout = lc.node_groups(local_size=1)
    opt = lc.NodeCub(model.parameters(), lr=1e-3, layout=layout, model=model, **kw)
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
    out["nodecub pbit"] = p(nodecub, vote="pbit")
    out["nodecub onebit"] = p(nodecub, vote="onebit")
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
        SYNC_BUDGET[_name] = 3  # the node mean's gradient presence, the world's NaN verdict, the vote's read

META_SKIP: dict[str, str] = {name: "DDP's C++ reducer cannot run on meta tensors (it crashes in backward); "
                             "the hook's launch/apply are the overlap driver's, audited there, and "
                             "make gpu-check runs this path on CUDA" for name in PATHS if name.startswith("ddp hook")}
"""Paths the meta audit cannot run, and why."""
