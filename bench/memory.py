#!/usr/bin/env python3
"""Memory per rank of one training step, without a GPU: GPT-shaped models of 125M to 70B parameters
under each optimizer setup, split into parameters, gradients, optimizer state, what else the
optimizer keeps, and the step's transient.

How: the model, its batch and everything the run allocates are fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and storages, no data) on the
``cpu`` device, in one process playing rank 0 of a fake process group of ``--world`` ranks
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once). torch's own
estimator, ``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker`` for FSDP2
models), counts the bytes of every live storage; ``bench/_fakemem.py``'s subclasses add the peak of
each phase and label each storage the optimizer allocates with the ``file:line`` that made it.
A step is forward on ``batch`` x ``--seq`` tokens (1 x 128), backward, ``opt.step()``; two steps
run (LocalCub: ``--local-steps`` H, the last ending a round) and the last is measured, so lazily
made state exists before it; ``zero_grad(set_to_none=True)`` between them. Bytes on this rank:

* ``params``, ``grads``: the rank's parameters (FSDP2: its shards, padding included) and their
  gradients, counted from the tensors' storages;
* ``state``: the storages in the optimizer's ``state`` after the step (LocalCub's inner optimizer's
  too, NodeCub's vote's);
* ``kept``: everything else still allocated after the step but the parameters, gradients and the
  batch: what the optimizer holds outside ``state`` (kept buffers, a message);
* ``transient``: the peak during ``opt.step()`` minus what was allocated right before it;
* ``fwd/bw``: the same for forward + backward: activations, logits, FSDP2's all-gathered parameters,
  and the gradients backward allocates;
* ``peak``: the highest total during the measured step (forward, backward, ``opt.step()``);
* ``host``: what the optimizer keeps in host memory (LocalCub's ``outer_state='host'``: θ_s, e_i), left out of
  every other column. Under the fake mode host and device tensors are both ``cpu``; the optimizer says which are
  its host tensors (``bench/_fakemem.py``'s ``host_tensors``), made at construction and written in place, so they
  are the same storages and bytes through the measured step (checked: the row fails otherwise) and the device's
  peak is the tracked one less them;
* ``per_param``: each divided by the rank's local parameter count (bytes per parameter).

The JSON rows add ``kept_at`` and ``transient_at`` (bytes per allocating line of src/lioncub or
torch/optim, after the step and at the step's peak; lines holding over 1 MiB),
``build_kept`` and ``build_transient`` (the optimizer's construction), ``run_peak`` (the whole run's
peak: FSDP2 + AdamW's first step counts DTensor's sharding propagation, which runs its ops on fake
tensors of the global shape inside this fake mode and allocates nothing on a real run),
``host_reads_at`` (the reads :class:`HostReads` answered, per library line; a ``.tolist()`` of k
elements is k reads), ``host_at`` (the host bytes per allocating line), ``source`` (the commit measured; the ``file:line`` refer to it), and for LocalCub
``round_transient`` and ``round_at``: the round's own peak over what was allocated when it began (the
step's transient may be its inner optimizer's).

Host reads: a fake tensor has no value, and ``.item()``, ``.tolist()`` or ``bool(t)`` of one raises
under FakeTensorMode. :class:`HostReads` answers every such read with 0 (``False``; 1.0 for floating
point, a step count or a scale that a caller may divide by): the ordinary path of the library's
agreements (no rank lacks a gradient, none saw a NaN, replicas equal), as
:mod:`lioncub.testing.audit` answers its ``meta`` tensors. Ops on real tensors only (a device mesh's
rank table) run as they are. A setup that still fails is a row with its error and the library line
that raised (``raised_at``), and the run goes on.

Fused loops: LionCub's default backend on CPU is :mod:`lioncub.fused`'s C loops, which take raw data
pointers: a fake tensor's is null (a segfault). ``--fused stub`` (default) runs that path with the C
functions replaced by no-ops (:func:`stub_fused_loops`): every buffer the step uses is a torch
allocation, counted as on a real run, and the loops only write into them (the Triton kernels take
the same buffers on a GPU). ``--fused off`` runs ``fused=False``, the torch ops.

Model (:class:`GPT`): GPT-3 shapes, tied input/output embeddings, 2048 learned positions, vocabulary
50304, blocks of LayerNorm, qkv Linear d->3d, out Linear d->d, LayerNorm, MLP d->4d->d (biases
everywhere), heads of 64. Setups (``--optimizers``), world W = R replicas x S shards:

* ``adamw``: the replicated model (DDP's layout: its buckets with ``gradient_as_bucket_view=True`` are
  the gradients; the all-reduce is not run) + ``torch.optim.AdamW(foreach=True)``, CUDA's default;
* ``fsdp_adamw``: FSDP2 HSDP, ``fully_shard`` of each block and the root on the R x S mesh, + AdamW;
* ``lioncub_onebit``, ``lioncub_pbit``: ``lioncub.LionCub`` on the replicated model, W voters;
* ``fsdp_lioncub_onebit``: ``fully_shard(block, mesh=mesh['shard'])`` per block, then the root; LionCub
  infers the replicas' group (R voters) from the mesh; ``--bf16`` sizes add the same with bf16
  parameters (``fsdp_lioncub_onebit_bf16``);
* ``localcub``: ``flat_localcub(local_steps=H, vote='onebit')``, replicated; the step ends a round;
* ``localcub_mean``: LocalCub's 8-bit lane mean with error feedback (``vote='pbit', bits=8,
  quantizer='l1', aggregate='mean', error_feedback=True``), replicated; ``localcub_mean_delay1`` the same
  streamed (``delay=1``: the second round's end, which applies the first's agreement and launches its
  own); ``fsdp_localcub_mean`` the lane mean on FSDP2's shards (``fully_shard`` on ``mesh['shard']``,
  R replicas agree); ``localcub_mean_host``, ``fsdp_localcub_mean_host``: the same with ``outer_state='host'``;
* ``nodecub``: ``flat_nodecub(vote='onebit')``, W/S nodes of S ranks (``node_groups(S)``); rank 0
  is local rank 0, which the shard plan gives the largest tensor first (the most loaded).

    PYTHONPATH=src python3 bench/memory.py --out bench/results/memory.json
    PYTHONPATH=src python3 bench/memory.py --sizes 7B --world 64 --shards 8 --append --out bench/results/memory.json
    PYTHONPATH=src python3 bench/memory.py --report-only --out bench/results/memory.json

write the rows (``--out``, JSON) and the report (``--md``, default ``--out`` with ``.md``); ``--sizes``
also takes ``LAYERSxD`` (``--vocab``, ``--seq``: a small GPT). ``tests/test_bench_memory.py`` checks the
numbers on a 2-layer GPT of width 64.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._fakemem import (SRC, HostReads, _local, _trackers, clear_library_caches, fake_world,  # noqa: E402
                            host_tensors, library_frame, state_tensors, storage_bytes, storage_ids, stub_fused_loops)
from bench.memory_report import DEVICE, _gib, report, table  # noqa: E402

VOCAB = 50304
POSITIONS = 2048
HEAD = 64
SIZES = {"125M": (12, 768), "1.3B": (24, 2048), "7B": (32, 4096), "70B": (80, 8192)}
"""Name -> (layers, width d)."""
OPTIMIZERS = ("adamw", "fsdp_adamw", "lioncub_onebit", "lioncub_pbit", "fsdp_lioncub_onebit", "localcub",
              "localcub_mean", "localcub_mean_host", "localcub_mean_delay1", "fsdp_localcub_mean",
              "fsdp_localcub_mean_host", "nodecub")


# ---------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, dtype=torch.float32):
        super().__init__()
        kw = dict(dtype=dtype)
        self.ln1, self.qkv, self.out = nn.LayerNorm(d, **kw), nn.Linear(d, 3 * d, **kw), nn.Linear(d, d, **kw)
        self.ln2, self.fc, self.proj = nn.LayerNorm(d, **kw), nn.Linear(d, 4 * d, **kw), nn.Linear(4 * d, d, **kw)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, d // HEAD, HEAD).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT of ``layers`` blocks of width ``d`` (tied embeddings); ``forward`` returns the loss."""

    def __init__(self, layers: int, d: int, vocab: int = VOCAB, positions: int = POSITIONS, dtype=torch.float32):
        super().__init__()
        kw = dict(dtype=dtype)  # made in ``dtype``: ``.to(dtype)`` cannot swap a tied fake parameter
        self.wte, self.wpe = nn.Embedding(vocab, d, **kw), nn.Embedding(positions, d, **kw)
        self.blocks = nn.ModuleList(Block(d, dtype) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, **kw)
        self.head = nn.Linear(d, vocab, bias=False, **kw)
        self.head.weight = self.wte.weight

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt_params(layers: int, d: int, vocab: int = VOCAB, positions: int = POSITIONS) -> int:
    """:class:`GPT`'s parameter count, by formula (the test checks it against the module)."""
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab * d + positions * d + layers * block + 2 * d


# ---------------------------------------------------------------------------------------------- setups
@dataclass
class Config:
    """One row's shape: the GPT, the world (``replicas`` x ``shards`` ranks), the setup's options."""

    size: str
    optimizer: str
    layers: int
    d: int
    vocab: int = VOCAB
    world: int = 8
    replicas: int = 2
    shards: int = 4
    local_steps: int = 2
    fused: str = "stub"
    batch: int = 1
    seq: int = 128

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.optimizer.endswith("_bf16") else torch.float32

    @property
    def steps(self) -> int:
        """Steps run; the last is measured (LocalCub's ends a round of ``local_steps``)."""
        if "localcub" not in self.optimizer:
            return 2
        return max(2, self.local_steps) * (2 if self.optimizer.endswith("_delay1") else 1)

    def lioncub_args(self) -> dict:
        return {} if self.fused == "stub" else dict(fused=False)


def _adamw(model, mesh, cfg):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _lioncub(vote):
    def make(model, mesh, cfg):
        from lioncub.optim.flags import flat_lioncub

        return flat_lioncub(model.parameters(), lr=1e-4, vote=vote, **cfg.lioncub_args())
    return make


def _localcub(model, mesh, cfg):
    from lioncub.optim.flags import flat_localcub

    return flat_localcub(model.parameters(), lr=1e-4, local_steps=cfg.local_steps, vote="onebit")


def _localcub_mean(delay, outer_state="device"):
    def make(model, mesh, cfg):
        from lioncub.optim.flags import flat_localcub

        return flat_localcub(model.parameters(), lr=1e-4, local_steps=cfg.local_steps, vote="pbit", bits=8,
                             quantizer="l1", aggregate="mean", error_feedback=True, delay=delay,
                             outer_state=outer_state)
    return make


def _nodecub(model, mesh, cfg):
    import lioncub
    from lioncub.optim.flags import flat_nodecub

    layout = lioncub.node_groups(cfg.shards)
    return flat_nodecub(model.parameters(), lr=1e-4, layout=layout, vote="onebit", **cfg.lioncub_args())


SETUPS: dict[str, tuple[Optional[str], Callable, str]] = {
    "adamw": (None, _adamw, "replicated (DDP layout) + AdamW(foreach)"),
    "fsdp_adamw": ("hsdp", _adamw, "FSDP2 HSDP (R x S) + AdamW(foreach)"),
    "lioncub_onebit": (None, _lioncub("onebit"), "replicated + LionCub(onebit), W voters"),
    "lioncub_pbit": (None, _lioncub("pbit"), "replicated + LionCub(pbit), W voters"),
    "fsdp_lioncub_onebit": ("shard", _lioncub("onebit"), "FSDP2 on mesh['shard'] + LionCub(onebit), R voters"),
    "fsdp_lioncub_onebit_bf16": ("shard", _lioncub("onebit"), "as fsdp_lioncub_onebit, bf16 parameters"),
    "localcub": (None, _localcub, "replicated + LocalCub(onebit, H): the step that ends a round"),
    "localcub_mean": (None, _localcub_mean(0), "replicated + LocalCub(8-bit lane mean, EF, H): a round's end"),
    "localcub_mean_host": (None, _localcub_mean(0, "host"), "as localcub_mean, outer_state='host' (θ_s, e_i)"),
    "localcub_mean_delay1": (None, _localcub_mean(1), "as localcub_mean, delay=1: the second round's end"),
    "fsdp_localcub_mean": ("shard", _localcub_mean(0), "FSDP2 on mesh['shard'] + LocalCub(lane mean), R agree"),
    "fsdp_localcub_mean_host": ("shard", _localcub_mean(0, "host"), "as fsdp_localcub_mean, outer_state='host'"),
    "nodecub": (None, _nodecub, "replicated + NodeCub(onebit), W/S nodes of S ranks"),
}
"""Name -> (FSDP2 layout: None replicated, ``'hsdp'`` the 2-D mesh, ``'shard'`` its shard dimension;
the optimizer's factory ``make(model, mesh, cfg)``; a line for the table)."""


# ---------------------------------------------------------------------------------------------- measure
def measure(size: str, optimizer: str, *, layers: Optional[int] = None, d: Optional[int] = None, **shape) -> dict:
    """One row: ``optimizer`` (a key of :data:`SETUPS`) on the GPT ``size`` (a key of :data:`SIZES`, or
    any name with ``layers`` and ``d``), as rank 0 of ``world`` = ``replicas`` x ``shards`` fake ranks
    (``shape``: :class:`Config`'s other fields). A setup that fails is a row with ``error`` and
    ``raised_at`` (the library's line)."""
    layers, d = (layers, d) if layers is not None else SIZES[size]
    cfg = Config(size, optimizer, layers, d, **shape)
    if cfg.replicas * cfg.shards != cfg.world:
        raise ValueError(f"replicas x shards must be the world size: {cfg.replicas} x {cfg.shards} != {cfg.world}")
    row = dict(size=size, layers=layers, d=d, params=gpt_params(layers, d, cfg.vocab), tied_embeddings=True,
               world=cfg.world, replicas=cfg.replicas, shards=cfg.shards, optimizer=optimizer,
               setup=SETUPS[optimizer][2], dtype=str(cfg.dtype).replace("torch.", ""), device=DEVICE,
               batch=cfg.batch, seq=cfg.seq, steps=cfg.steps,
               local_steps=cfg.local_steps if "localcub" in optimizer else None,
               fused=cfg.fused if "lioncub" in optimizer or optimizer == "nodecub" else None, error=None)
    t0 = time.process_time()
    try:
        row.update(_run(cfg))
    except Exception as exc:  # a setup that cannot run under the fake mode is a finding, not a crash
        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        row["raised_at"] = library_frame(exc.__traceback__)
    row["cpu_s"] = round(time.process_time() - t0, 2)
    return row


def _run(cfg: Config) -> dict:
    """The fake world and mesh (real tensors), then :func:`_steps` inside the fake mode; the library's
    caches emptied before and after."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    stub = stub_fused_loops() if cfg.fused == "stub" else contextlib.nullcontext()
    clear_library_caches()
    try:
        with fake_world(cfg.world), stub:
            mesh = init_device_mesh("cpu", (cfg.replicas, cfg.shards), mesh_dim_names=("replicate", "shard"))
            with FakeTensorMode():
                return _steps(cfg, mesh)
    finally:
        clear_library_caches()


def _steps(cfg: Config, mesh) -> dict:
    """Build the model (FSDP2 as the setup says) and the optimizer, run ``cfg.steps`` steps under the
    tracker, and count the last one."""
    layout, make, _ = SETUPS[cfg.optimizer]
    PhaseTracker, FSDPPhaseTracker = _trackers()
    model = GPT(cfg.layers, cfg.d, cfg.vocab, dtype=cfg.dtype)
    if layout is not None:
        from torch.distributed.fsdp import fully_shard

        on = mesh if layout == "hsdp" else mesh["shard"]
        for block in model.blocks:
            fully_shard(block, mesh=on)
        fully_shard(model, mesh=on)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    params = list(model.parameters())
    local_params = sum(_local(p).numel() for p in params)
    if layout is None:
        tracker = PhaseTracker()
        tracker.track_external(model, tokens, targets)
    else:
        tracker = FSDPPhaseTracker(model)
        tracker.track_inputs((tokens, targets))
    reads = HostReads()
    with tracker, reads:
        with tracker.phase("build", sites=True):
            opt = make(model, mesh, cfg)
        if hasattr(opt, "_round"):  # LocalCub: the round's own numbers too (its step's peak may be the inner step's)
            _measure_rounds(opt, tracker)
        for step in range(cfg.steps):
            hosted = storage_ids(host_tensors(opt))  # (the last step's: counted apart, the same storages after it)
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
            with tracker.phase("fwd_bw"):
                loss = model(tokens, targets)
                loss.backward()
                del loss
            grads = storage_bytes(p.grad for p in params)
            reads_before = reads.reads
            with tracker.phase("step", sites=True):
                opt.step()
            if step < cfg.steps - 1:
                opt.zero_grad(set_to_none=True)
        if storage_ids(host_tensors(opt)) != hosted:
            raise RuntimeError("the optimizer's host tensors changed during the measured step: its device peak is "
                               "not the tracked one less them")
        host = storage_bytes(host_tensors(opt))
        state = storage_bytes([t for t in state_tensors(opt) if not storage_ids([t]) & hosted])
        param_bytes = storage_bytes(params)
        end = tracker.total() - host
        before_fwd, fwd_bw_peak, _ = tracker.phases["fwd_bw"]
        before_step, step_peak, _ = tracker.phases["step"]
    small = 2**20  # sites holding less than 1 MiB are left out
    out = dict(local_params=local_params, voters=getattr(getattr(opt, "voter", opt), "world_size", None),
               build_kept=tracker.phases["build"][2] - tracker.phases["build"][0],
               build_transient=tracker.phases["build"][1] - tracker.phases["build"][0],
               run_peak=tracker.overall_peak() - host,
               host_reads_per_step=reads.reads - reads_before, host_reads_at=dict(reads.where),
               kept_at=_largest(_less(tracker.alive, _sites(tracker, host_tensors(opt))), small),
               transient_at=_largest(tracker.at_peak["step"], small),
               host_at=_largest(_sites(tracker, host_tensors(opt)), small))
    if "round" in tracker.phases:
        before, peak, _ = tracker.phases["round"]
        out.update(round_transient=peak - before, round_at=_largest(tracker.at_peak["round"], small))
    out["bytes"] = dict(params=param_bytes, grads=grads, state=state,
                        kept=end - param_bytes - grads - state - storage_bytes([tokens, targets]),
                        transient=step_peak - before_step, fwd_bw=fwd_bw_peak - before_fwd,
                        peak=max(fwd_bw_peak, step_peak) - host, host=host)
    out["per_param"] = {k: round(v / local_params, 3) for k, v in out["bytes"].items()}
    return out


def _measure_rounds(opt, tracker) -> None:
    """Wrap ``opt._round`` (on the instance: no file changes) in the tracker's ``round`` phase."""
    round_ = opt._round

    def measured():
        with tracker.phase("round", sites=True):
            return round_()
    opt._round = measured


def _sites(tracker, tensors) -> dict[str, int]:
    """Bytes of the distinct storages under ``tensors`` per allocating line (as the tracker labelled them)."""
    out, seen = {}, set()
    for t in tensors:
        st = _local(t).untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            site = getattr(tracker._WINFO.get(st, (None, None))[0], "site", "?")
            out[site] = out.get(site, 0) + st.nbytes()
    return out


def _less(by_site: dict[str, int], minus: dict[str, int]) -> dict[str, int]:
    return {k: v - minus.get(k, 0) for k, v in by_site.items()}


def _largest(by_site: dict[str, int], least: int) -> dict[str, int]:
    """The sites holding more than ``least`` bytes, largest first."""
    return dict(sorted(((k, v) for k, v in by_site.items() if v > least), key=lambda kv: -kv[1]))


def source() -> dict:
    """The tree measured: its commit and the files of src/lioncub changed since (read-only git calls; the
    ``file:line`` sites of a row refer to that tree)."""
    import subprocess

    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], cwd=SRC.parent, capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain", "--", "src/lioncub").splitlines() if line[3:]]
    return dict(commit=git("rev-parse", "--short", "HEAD").strip() or None, changed=changed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"), help="JSON rows")
    ap.add_argument("--md", help="markdown table (default: --out with .md)")
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help=f"comma-separated, of {', '.join(SIZES)}, or LAYERSxD (e.g. 2x64: a small GPT of that shape)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (batch 1)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--bf16", default="7B", help="sizes that add the fsdp_lioncub_onebit_bf16 row ('' for none)")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--shards", type=int, default=4, help="S: FSDP2's shard group, NodeCub's ranks per node")
    ap.add_argument("--replicas", type=int, help="R (default: world / shards)")
    ap.add_argument("--local-steps", type=int, default=2, help="LocalCub's H")
    ap.add_argument("--fused", choices=("stub", "off"), default="stub")
    ap.add_argument("--append", action="store_true", help="add the rows to those already in --out")
    ap.add_argument("--report-only", action="store_true", help="rebuild the table from an existing --out")
    args = ap.parse_args(argv)
    md = args.md or str(Path(args.out).with_suffix(".md"))
    if args.report_only:
        rows = json.loads(Path(args.out).read_text())
    else:
        replicas = args.replicas or args.world // args.shards
        sizes = [s for s in args.sizes.split(",") if s]
        bf16 = {s for s in args.bf16.split(",") if s}
        rows, tree = [], source()
        for size in sizes:
            names = [o for o in args.optimizers.split(",") if o]
            if size in bf16 and "fsdp_lioncub_onebit" in names:
                names.insert(names.index("fsdp_lioncub_onebit") + 1, "fsdp_lioncub_onebit_bf16")
            for name in names:
                layers, d = SIZES[size] if size in SIZES else map(int, size.split("x"))
                row = measure(size, name, layers=layers, d=d, world=args.world, replicas=replicas,
                              shards=args.shards, local_steps=args.local_steps, fused=args.fused, vocab=args.vocab,
                              seq=args.seq)
                rows.append(dict(row, source=tree))
                print(f"{size:5s} {name:26s} {row['cpu_s']:7.1f}s "
                      + (f"error at {row.get('raised_at')}: {row['error'][:200]}" if row["error"] else
                         " ".join(f"{k}={_gib(v)}" for k, v in row["bytes"].items())), flush=True)
        if args.append and Path(args.out).exists():
            rows = json.loads(Path(args.out).read_text()) + rows
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    Path(md).write_text(report(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
