"""The regime r of a race (issue 32) and the GPU setting with the same r; used by ``bench/race.py``."""
from __future__ import annotations

import time

REFERENCE = "lion-ddp"
"""The race's reference (Lion fp32): it measures r before its runs and, by default, sets the targets."""


def measure_compute(model, loader, repeats: int = 8) -> float:
    """Seconds of one step of local AdamW with no communication, the slowest rank's
    (:func:`lioncub.harness.regime.measure_step`). 1 / this is a run's compute-bound step rate, against which its
    steps per second are held (issue 48's definition: the steps per second of local AdamW with no communication,
    same host, same run)."""
    from lioncub.harness.regime import measure_step

    return measure_step(model, loader, repeats=repeats)


def measure_regime(model, loader, n_params: int, repeats: int = 3) -> dict:
    """The race's regime r, measured before the reference's run: the median over ``repeats`` of one
    forward + backward of a batch (no communication) and of one fp32 SUM all-reduce of ``n_params``
    elements (the gradient DDP sends each step), the slowest rank's of each; r = all-reduce / compute.
    The batches are put back (the loader restarts where it was), the gradients cleared."""
    import statistics

    import torch
    import torch.distributed as dist

    state = loader.state_dict()
    flat = torch.zeros(n_params)
    compute, wire = [], []
    for _ in range(repeats):
        x, y = loader.next_batch()
        t0 = time.perf_counter()
        model(x, y)[1].backward()
        compute.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        wire.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    loader.load_state_dict(state)
    slowest = torch.tensor([statistics.median(compute), statistics.median(wire)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    c, w = slowest.tolist()
    return dict(compute_s=c, allreduce_s=w, r=w / c)


# A GPU setting with the same r (issue 32): r = ring fp32 all-reduce time / compute time per step.
# For a GPT of N parameters, T tokens per GPU per step, F effective FLOP/s and P nodes on a link of
# B bit/s: compute = 6·N·T / F; all-reduce = 2·(P-1)/P · 32·N / B; so r = 2·(P-1)/P · 32·F / (6·T·B)
# and N cancels. The reference GPU: an H100 at F = 4e14 (about 40 % of its dense bf16 peak), T = 16384
# tokens per GPU per step, P = 4 nodes: r = 1.95e11 / B.
GPU_SETTING = dict(gpu="H100", flops=4e14, tokens_per_gpu=16384, nodes=4)


def gpu_link_for(r: float, setting: dict = GPU_SETTING) -> float:
    """The link (bit/s) at which ``setting`` sits at regime ``r`` (the arithmetic above)."""
    P, F, T = setting["nodes"], setting["flops"], setting["tokens_per_gpu"]
    return 2 * (P - 1) / P * 32 * F / (6 * T * r)


def regime_text(runs: list[dict]) -> str:
    """The measured regime of a race (mean r over the runs that measured it: the reference's, and the first with
    ``--regime``) and its GPU counterpart."""
    rs = [r["regime"] for r in runs if r.get("regime")]
    s = GPU_SETTING
    if not rs:  # an earlier race: r from the step rates, the reference's s/step over the fastest method's, less 1
        ref = [r for r in runs if r["method"] == REFERENCE]
        if not ref:
            return "regime: not measured (no reference run)"
        per_step = {}
        for r in runs:
            last = r["evals"][-1]
            per_step.setdefault(r["method"], []).append(last["t"] / max(1, last["step"]))
        mean = {m: sum(v) / len(v) for m, v in per_step.items()}
        r = mean[REFERENCE] / min(mean.values()) - 1
        return (f"regime r ~ {r:.2g} (estimated: {REFERENCE}'s s/step over the fastest method's, less 1; not measured "
                f"in this race); the same r on {s['nodes']} {s['gpu']} nodes: a {gpu_link_for(r) / 1e9:.3g} Gbit/s link")
    r = sum(x["r"] for x in rs) / len(rs)
    c = sum(x["compute_s"] for x in rs) / len(rs)
    w = sum(x["allreduce_s"] for x in rs) / len(rs)
    link = gpu_link_for(r)
    who = ", ".join(sorted({x["method"] for x in runs if x.get("regime")}))
    return (f"regime r = {r:.2g} (fp32 all-reduce {w * 1e3:.0f} ms / compute {c * 1e3:.0f} ms per step, measured "
            f"before the runs of {who}); the same r for a GPT on {s['nodes']} nodes of {s['gpu']}s "
            f"({s['flops']:.0e} FLOP/s effective, {s['tokens_per_gpu']} tokens per GPU per step): a "
            f"{link / 1e9:.3g} Gbit/s link (r = 2(P-1)/P·32·F / (6·T·B), the model size cancels)")
