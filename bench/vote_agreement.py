"""How far each vote's direction is from Lion's, along a real Lion Cub run (the study's part B).

Lion moves every coordinate by sign(Σ_i c_i), the sign of the workers' summed
c = β1·m + (1-β1)·g; a vote moves it by what the workers' quantized c_i decide. Because the
momentum is linear in the gradients, the mean of the workers' local momenta *is* Lion's
momentum: the only thing a vote changes is this sign. This script trains the study's 1-bit
run (4 workers; lr 1e-4, wd 1.0, 2000 steps; 3 and 12 sequences per worker) and, every
``--every`` steps before the step, gathers every worker's c over all coordinates and asks
what the 1-bit, 4-bit binary and 8-bit L1 votes would send, against sign(Σ c_i):

- ``flip``: the vote's sign is opposite; ``zero``: the vote is 0 where Σ c_i is not;
- ``flip_mass`` / ``zero_mass``: the same, weighted by |Σ c_i| (the share of Lion's
  "evidence" the vote gets wrong or drops); ``ties``: Σ_i sign(c_i) = 0;
- ``applied``: the same rates of what the run's own step moved, read from its parameters one
  step later (``--variants`` probes the study's ablate runs, e.g. issue 34's variants, whose
  vote is not one of the three above).

The probe reads the optimizer's state only, so the run's final loss equals the study's record
of the same experiment (checked when ``--study`` has it). Run alone on the host (4 workers)::

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.vote_agreement --out bench/results/vote_agreement.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.study import Job as StudyJob, train_one
from bench.study_plan import RECIPE, Spec, _batch_spec, ablate_plan
from lioncub.harness.data import ensure_prepared
from lioncub.harness.launch import spawn_local
from lioncub.harness.metrics import read_jsonl
from lioncub.instruments import tie_rate, update_vectors
from lioncub.votes.api import reference_vote

PROBE_VOTES = {"1-bit": dict(method="onebit"), "4-bit binary": dict(method="pbit", bits=4),
               "8-bit L1": dict(method="pbit", bits=8, quantizer="l1")}
RATES = ("flip", "zero", "flip_mass", "zero_mass")
APPLIED = "applied"  # what the run's own step moved (its variant's real vote), read from the parameters
WINDOWS = ((0, 400), (400, None))  # the byte-unigram plateau (every run leaves it by step 400), then the rest


def agreement(cs: list[torch.Tensor], step: int) -> dict:
    """Each of ``PROBE_VOTES`` on the workers' c's (one flat tensor per worker) against sign(Σ c_i):
    ``{"ties": .., name: {"flip", "zero", "flip_mass", "zero_mass"}}``. Mass is |Σ c_i|; a vote's
    ties alternate by ``step`` (the optimizer's step count) as in ``LionCub``."""
    if len(cs) < 2 or any(c.shape != cs[0].shape or c.dim() != 1 for c in cs):
        raise ValueError("cs must be two or more flat tensors of one shape, one per worker")
    total = sum(c.double() for c in cs)
    exact, mass = torch.sign(total), total.abs()
    whole = float(mass.sum()) or 1.0
    out = {"ties": tie_rate(cs)}
    for name, kw in PROBE_VOTES.items():  # deterministic quantizers: no generators needed
        u = reference_vote(cs, step=step, **kw).double()  # -1 / 0 / +1
        flip, zero = u * exact < 0, (u == 0) & (exact != 0)
        out[name] = {"flip": float(flip.double().mean()), "zero": float(zero.double().mean()),
                     "flip_mass": float(mass[flip].sum()) / whole, "zero_mass": float(mass[zero].sum()) / whole}
    return out


def applied_rates(before: torch.Tensor, after: torch.Tensor, lr: float, wd: float, total: torch.Tensor) -> dict:
    """What the step that ran actually applied, against sign(``total``) (Σ_i c_i of that step):
    u = (θ_before·(1 − lr·wd) − θ_after) / lr, read as −1 / 0 / +1 (|·| < 1/2: 0), and its
    ``flip`` / ``zero`` rates and masses as :func:`agreement`'s. Any variant's real step (error
    feedback, stochastic signs, held ties): nothing is recomputed, the parameters are read."""
    step = (before.double() * (1 - lr * wd) - after.double()) / lr
    u = torch.where(step.abs() < 0.5, 0.0, torch.sign(step))
    exact, mass = torch.sign(total), total.abs()
    whole = float(mass.sum()) or 1.0
    flip, zero = u * exact < 0, (u == 0) & (exact != 0)
    return {"flip": float(flip.double().mean()), "zero": float(zero.double().mean()),
            "flip_mass": float(mass[flip].sum()) / whole, "zero_mass": float(mass[zero].sum()) / whole}


def window_means(probes: list[dict]) -> dict:
    """{window label: {vote: {rate: mean over the window's probes}}}, windows as ``WINDOWS``."""
    out = {}
    for lo, hi in WINDOWS:
        inside = [p for p in probes if p["step"] >= lo and (hi is None or p["step"] < hi)]
        if not inside:
            continue
        label = f"{lo}-{hi if hi is not None else 'end'}"
        out[label] = {"ties": sum(p["ties"] for p in inside) / len(inside)}
        for name in PROBE_VOTES:
            out[label][name] = {r: sum(p[name][r] for p in inside) / len(inside) for r in RATES}
        applied = [p["applied"] for p in inside if "applied" in p]
        if applied:
            out[label][APPLIED] = {r: sum(a[r] for a in applied) / len(applied) for r in RATES}
    return out


def agreement_spec(per_worker: int, seed: int = 0, lr: float = 1e-4) -> Spec:
    """The study's 1-bit batch run at ``per_worker`` sequences for the recipe's 2000 steps (the same
    experiment key, so the same record: "B=12 1-bit lr=0.0001", "B=48@2000 1-bit lr=0.0001")."""
    return _batch_spec("1-bit", per_worker, RECIPE["steps"], RECIPE["warmup"], lr, seed)


@dataclass
class Job(StudyJob):
    """The study's job (``out`` unused: the records come back to the caller) and the probe's interval."""

    every: int = 25


def agreement_worker(job: Job) -> list[dict]:
    """Every rank trains every spec with the probe; every rank returns the records."""
    records = []
    for spec in job.specs:
        probes, last = [], {}

        def theta(opt):
            return torch.cat([p.detach().reshape(-1).float() for g in opt.param_groups for p in g["params"]])

        def probe(step, opt):
            if last:  # the call after a probe: the probed step has run, what did it apply?
                probes[-1]["applied"] = applied_rates(last["theta"], theta(opt), last["lr"], last["wd"], last["total"])
                last.clear()
            if step % job.every:
                return
            c = torch.cat([x.reshape(-1).float() for x in update_vectors(opt)])
            everyone = [torch.empty_like(c) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, c)
            probes.append({"step": step, **agreement(everyone, getattr(opt, "steps", 0))})
            group = opt.param_groups[0]
            last.update(theta=theta(opt), lr=group["lr"], wd=group["weight_decay"],
                        total=sum(x.double() for x in everyone))

        t0 = time.perf_counter()
        rec = train_one(spec, job.cache_dir, eval_every=spec.steps // 20, probe=probe)
        records.append({"key": rec["key"], "label": spec.label, "seed": spec.seed, "per_worker": spec.batch,
                        "steps": spec.steps, "final": rec["final"], "wall_s": time.perf_counter() - t0,
                        "probes": probes, "windows": window_means(probes)})
        if dist.get_rank() == 0:
            print(f"[agreement] {spec.label} seed {spec.seed}: val {rec['final']['val_loss']:.4f} "
                  f"({records[-1]['wall_s']:.0f} s)", flush=True)
    return records


def table(records: list[dict], study: list[dict]) -> list[str]:
    """Markdown: per run and window, each vote's flip / zero rates and masses (percent)."""
    known = {r["key"]: r["final"]["val_loss"] for r in study}
    lines = ["| run | steps | ties | vote | flip | zero | flip mass | zero mass |", "|---|---|---|---|---|---|---|---|"]
    for rec in records:
        for window, w in rec["windows"].items():
            for name in [*PROBE_VOTES, *([APPLIED] if APPLIED in w else [])]:
                v = w[name]
                lines.append(f"| {rec['label']} | {window} | {100 * w['ties']:.1f} % | {name} | "
                             + " | ".join(f"{100 * v[r]:.2f} %" for r in RATES) + " |")
    lines.append("")
    for rec in records:
        same = known.get(rec["key"])
        verdict = "equal" if same == rec["final"]["val_loss"] else "DIFFERS"
        check = "" if same is None else f"; the study's record: {same:.4f} ({verdict})"
        lines.append(f"- {rec['label']} seed {rec['seed']}: final val loss {rec['final']['val_loss']:.4f}{check}; "
                     f"{rec['wall_s']:.0f} s")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-worker", default="3,12", help="comma list of sequences per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="", help="';'-separated labels of the study's ablate runs to probe too "
                                                   "(e.g. '1-bit, ties hold the last vote (onebit-hold)')")
    ap.add_argument("--every", type=int, default=25, help="probe every N steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--study", default="bench/results/study_recipe.jsonl", help="records to check the losses against")
    ap.add_argument("--out", default="bench/results/vote_agreement.json")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        with open(a.report_only) as f:
            print("\n".join(table(json.load(f)["records"], read_jsonl(a.study, partial=True))))
        return
    if a.every < 1:
        raise SystemExit(f"--every must be a positive step count, got {a.every}")
    from lioncub.harness.config import default_cache_dir

    cache_dir = default_cache_dir()
    ensure_prepared("shakespeare", cache_dir)
    specs = [agreement_spec(int(p), seed=a.seed) for p in a.per_worker.split(",") if p]
    if a.variants:  # the study's ablate runs by label (issue 34's variants: study_plan.VOTE_QUALITY)
        ablate = {s.label: s for s in ablate_plan([a.seed])}
        unknown = [v for v in a.variants.split(";") if v not in ablate]
        if unknown:
            raise SystemExit(f"--variants: no ablate run labelled {unknown[0]!r}; labels: {sorted(ablate)}")
        specs += [ablate[v] for v in a.variants.split(";")]
    records = spawn_local(agreement_worker, Job(specs, out="", cache_dir=cache_dir, every=a.every), a.nproc)
    lines = table(records, read_jsonl(a.study, partial=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"nproc": a.nproc, "every": a.every, "records": records}, f, indent=1)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
