"""The training loop behind ``lioncub train``.

``run(config) -> summary`` launches the workers (see ``launch.py``) and returns
rank 0's summary. The steps are :class:`~lioncub.harness.loop.Loop`'s (the study's and the race's loop
too) on the method of :func:`~lioncub.harness.method.make_method`; each step, per rank::

    x, y   = loader.next_batch()            # this rank's own shard
    loss   = model(x, y); loss.backward()   # timed: "compute"
    opt.step()                              # vote timing and bytes from opt.last_step_stats
                                            # (harness-timed gradient allreduce for lion/adamw)

and every ``log_every`` steps one record goes to ``RUN/metrics.jsonl``::

    {"kind": "step", "step", "loss" (mean over ranks), "lr", "t_step", "t_compute",
     "t_vote", "t_other", "bytes_sent", "bytes_recv", "n_collectives", "tokens_per_s",
     "train_time" (sum of t_step so far), "elapsed" (wall time incl. evals),
     ["skipped_steps" (LionCub: non-finite steps skipped so far)]}
    {"kind": "eval", "step", "val_loss", ["val_acc"], "train_time", "elapsed"}
"""
from __future__ import annotations

import contextlib
import importlib
import os
import random
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import LionCub, NodeCub, comm
from ..testbed.straggler import PAUSE_FLAG, SLOW_FLAG, Straggler, check_workers, format_specs
from . import checkpoint
from .config import TrainConfig
from .data import (ImageLoader, TokenLoader, ensure_prepared, eval_batches, image_eval_batches,
                   load_images, read_meta)
from .data.text import prepared_dir
from .launch import launch, resolve_device
from .loop import Loop, StepClock, StepInfo
from .metrics import MetricsWriter, ProgressBar, TensorBoardWriter, progress_enabled, write_csv
from .method import batch_loss, lane_options, make_method, make_optimizer, vote_method
from .models import build_model, param_groups
from .regime import resolve_setting
from .schedule import lr_at, warmup_factor


__all__ = ["run", "check_inputs", "train_worker", "evaluate", "summarize", "lr_factor", "batch_loss", "lane_options",
           "make_optimizer", "vote_method", "StepClock"]


def run(config: TrainConfig) -> dict:
    """Train per ``config`` (spawning or joining workers as needed); return rank 0's summary."""
    return launch(train_worker, config)


def check_inputs(config: TrainConfig, world: int, *, prepare: bool = True) -> None:
    """Raise ValueError, naming the flag, for a run that cannot start: a device that is not
    there, missing or too little data, an unwritable ``out``, a p-bit lane that would overflow.
    Runs before any worker starts (``lioncub train``). ``prepare=False`` reads text data only
    if it is already tokenised (torchrun's ranks must not all tokenise at once)."""
    try:
        resolve_device(config.device)
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from None
    # the ranks a slowdown names must be workers (the form and the numbers are TrainConfig's to check)
    check_workers(config.slow_workers, config.pause_workers, world, names=(SLOW_FLAG, PAUSE_FLAG))
    if config.nodes > 1 and world % config.nodes:
        raise ValueError(f"--nodes {config.nodes} must divide the number of workers, {world} (nodes of equal size)")
    voters = config.nodes if config.nodes > 1 else world  # NodeCub: one voter per node
    method = vote_method(config)
    if method is not None and method.LANE_BITS:  # lanes that too many voters would overflow
        try:
            method(voters, config.bits, config.quantizer)
        except ValueError as exc:
            raise ValueError(f"--bits/--quantizer: {exc}") from None
    if config.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")  # needs the tensorboard package
        except ImportError:
            raise ValueError(f"--tensorboard {config.tensorboard!r}: needs the tensorboard package "
                             "(pip install tensorboard)") from None
    if config.pace == "timed":  # each rank takes its own steps a round: a step count is not the same on every rank
        if config.time_budget is None:
            raise ValueError("--pace timed: each worker takes its own steps a round, so the run stops and evaluates "
                             "on the agreed clock: give --budget SECONDS")
        if config.ckpt_every:
            raise ValueError("--pace timed: each worker takes its own steps a round; --ckpt-every counts steps: "
                             "leave it 0")
    _check_data(config, world, prepare)
    try:
        os.makedirs(config.out, exist_ok=True)
        if not os.access(config.out, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise ValueError(f"--out {config.out!r}: cannot write the run directory there ({exc.strerror})") from None


def _check_data(config: TrainConfig, world: int, prepare: bool) -> None:
    data = config.data
    if config.is_gpt:
        wanted = "a GPT model takes 'shakespeare', a directory holding train.bin/val.bin or a .txt file"
        if data != "shakespeare" and not (os.path.isfile(data) or os.path.isfile(os.path.join(data, "train.bin"))):
            raise ValueError(f"--data {data!r}: not found or not text data; {wanted}")
        if os.path.isfile(data) and not data.endswith(".txt"):
            raise ValueError(f"--data {data!r}: not a .txt file; {wanted}")
        token_dir = prepared_dir(data, config.cache_dir)
        if not prepare and not os.path.exists(os.path.join(token_dir, "train.bin")):
            return  # tokenised by rank 0 once the workers start
        try:
            token_dir = ensure_prepared(data, config.cache_dir)
            TokenLoader(os.path.join(token_dir, "train.bin"), block_size=config.block_size,
                        batch_size=config.batch_size, rank=world - 1, world_size=world)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--data {data!r}: {exc}") from None
        val = os.path.join(token_dir, "val.bin")
        n_val = os.path.getsize(val) // 2 // (config.block_size + 1) if os.path.exists(val) else 0
        if n_val < world:
            raise ValueError(f"--data {data!r}: val.bin holds {n_val} windows of --block-size {config.block_size} "
                             f"+ 1 tokens; each of the {world} workers needs one (shorten --block-size)")
        vocab = read_meta(token_dir)["vocab_size"]
        if config.vocab_size is not None and config.vocab_size < vocab:
            raise ValueError(f"--vocab-size {config.vocab_size}: the data has {vocab} token values; "
                             f"give at least {vocab} (or leave it out)")
        return
    if data != "digits" and not os.path.exists(data):
        raise ValueError(f"--data {data!r}: not found; an image model takes 'digits', an .npz file or an image folder")
    try:
        images = load_images(data, seed=config.seed)
        ImageLoader(images.x_train, images.y_train, batch_size=config.batch_size, rank=world - 1, world_size=world)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--data {data!r}: {exc}") from None


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` (:func:`schedule.lr_at`);
    with ``time_budget``: constant after the warm-up (:func:`schedule.warmup_factor`)."""
    if config.time_budget is not None:
        return warmup_factor(step, config.warmup_steps)
    return lr_at(step, config.steps, config.warmup_steps, config.min_lr_ratio)


class _Data:
    """The rank's training loader, its fixed validation batches and what the model needs to know.

    ``device``: the run's device, which the barrier names under NCCL."""

    def __init__(self, config: TrainConfig, rank: int, world: int, device: torch.device | None = None):
        kw = dict(batch_size=config.batch_size, rank=rank, world_size=world, seed=config.seed)
        if config.is_gpt:
            if rank == 0:  # one rank tokenises; the others wait at the barrier
                ensure_prepared(config.data, config.cache_dir)
            comm.barrier(device=device)
            token_dir = ensure_prepared(config.data, config.cache_dir)
            self.info = read_meta(token_dir)
            self.loader = TokenLoader(os.path.join(token_dir, "train.bin"), block_size=config.block_size, **kw)
            self.val = list(eval_batches(os.path.join(token_dir, "val.bin"), block_size=config.block_size,
                                         batch_size=config.batch_size, n_batches=config.eval_batches,
                                         rank=rank, world_size=world))
            self.items_per_step = config.batch_size * config.block_size * world  # tokens
        else:
            images = load_images(config.data, seed=config.seed)
            self.info = images.info
            self.loader = ImageLoader(images.x_train, images.y_train, **kw)
            self.val = list(image_eval_batches(images.x_val, images.y_val, batch_size=config.batch_size,
                                               n_batches=config.eval_batches, rank=rank, world_size=world))
            self.items_per_step = config.batch_size * world  # images


@torch.no_grad()
def evaluate(model, val, is_gpt: bool, device=None, autocast=contextlib.nullcontext) -> dict:
    """Mean validation loss (and accuracy for images) over every rank's fixed batches ``val``
    (an all-reduce: every rank of the group calls it)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in val:
        x, y = x.to(device), y.to(device)
        with autocast():
            loss, correct = batch_loss(model, x, y, is_gpt)
        totals[0] += loss.double() * len(y)
        totals[1] += 0 if correct is None else correct.double()
        totals[2] += len(y)
    comm.all_reduce(totals)
    model.train()
    out = {"val_loss": (totals[0] / totals[2]).item()}
    if not is_gpt:
        out["val_acc"] = (totals[1] / totals[2]).item()
    return out


def train_worker(config: TrainConfig) -> dict:
    """One rank's training run inside an initialised process group; returns the run summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = resolve_device(config.device, int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(config.seed)  # same init on every rank (LionCub also broadcasts rank 0's)
    np.random.seed(config.seed + rank)
    random.seed(config.seed + rank)
    data = _Data(config, rank, world, device)
    model = build_model(config, data.info).to(device)
    torch.manual_seed(config.seed + 1000 + rank)  # dropout masks differ across ranks, as their data does
    if config.optimizer != "lioncub":
        for t in model.state_dict().values():  # on ``device``, as the model is
            comm.broadcast(t, src=0)
    resume_from = _resume_path(config, device)
    config = resolve_setting(config)  # --local-setting link: LocalCub(aggregation='auto') picks in its first round
    groups = param_groups(model, lr=config.lr, weight_decay=config.weight_decay,
                          lr_embed=config.lr_embed, lr_head=config.lr_head)
    cuda = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    method = make_method(config, model, groups, autocast=autocast)
    opt = method.opt
    start = 0
    if resume_from:
        meta = checkpoint.load_checkpoint(resume_from, model=model, optimizer=opt, loader=data.loader,
                                          device=device, seed=config.seed)
        start = method.steps = meta["step"]
    budget = config.time_budget
    writer = MetricsWriter(os.path.join(config.out, "metrics.jsonl"), enabled=rank == 0,
                           truncate_after_step=start if resume_from else None)
    board = TensorBoardWriter(config.tensorboard and os.path.join(config.tensorboard, config.label),
                              enabled=rank == 0, purge_step=start + 1 if resume_from else None)
    bar = ProgressBar(config.steps if budget is None else None, label=config.label, initial=start,
                      enabled=rank == 0 and progress_enabled(config.progress))
    n_params = sum(p.numel() for g in groups for p in g["params"])
    steps, evals, t_begin = [], [], time.perf_counter()
    trained = dict(s=0.0)  # this rank's training seconds (every step's, logged or not)

    def on_step(info: StepInfo) -> None:
        done = info.step
        trained["s"] = info.train_time
        if method.uneven_steps:  # (--pace timed) a record, and its all-reduce, at each round's end: every rank alike
            if not info.synced:
                return
        elif done % config.log_every and done != config.steps:
            return
        mean_loss = info.loss.float().clone()
        comm.all_reduce(mean_loss)
        record = {"kind": "step", "step": done, "loss": mean_loss.item() / world, "lr": info.lr * method.shares[-1],
                  "t_step": info.t_step, "t_compute": info.t_compute, "t_vote": method.t_vote,
                  "t_other": info.t_step - info.t_compute - method.t_vote - info.t_slept, **method.traffic,
                  "tokens_per_s" if config.is_gpt else "images_per_s": data.items_per_step / info.t_step,
                  "train_time": info.train_time, "elapsed": time.perf_counter() - t_begin,
                  **({"t_slept": info.t_slept} if straggler is not None else {})}
        steps.append(record)
        writer.write(record)
        board.write(record)
        bar.update(done, f"loss {record['loss']:.3f} | {1e3 * info.t_step:.0f} ms/step")

    def on_eval(scores: dict) -> None:
        record = {"kind": "eval", **{k: v for k, v in scores.items() if k not in ("clock", "train_time")},
                  "train_time": scores["clock"] if budget is not None else scores["train_time"],
                  "elapsed": time.perf_counter() - t_begin}
        evals.append(record)
        writer.write(record)
        board.write(record)

    def after_step(done: int) -> None:
        if config.ckpt_every and done % config.ckpt_every == 0:
            checkpoint.save_checkpoint(config.out, done, model=model, optimizer=opt, loader=data.loader,
                                       meta={"label": config.label, "config": config.as_dict()},
                                       keep=config.keep_ckpts)

    model.train()
    straggler = (Straggler.for_rank(rank, config.slow_workers, config.pause_workers)
                 if config.slow_workers or config.pause_workers else None)  # the testbed's slower worker
    loop = Loop(lr=lambda step, clock: config.lr * lr_factor(step, config), budget=budget,
                steps=None if method.uneven_steps else config.steps,  # (timed: the agreed clock alone stops it)
                eval_every=config.eval_every, eval_every_s=config.eval_every_s, device=device,
                on_step=on_step, on_eval=on_eval, after_step=after_step, straggler=straggler)
    if start < config.steps:
        loop.run(method, data.loader, lambda: evaluate(model, data.val, config.is_gpt, device, autocast),
                 start=start, cuda=cuda)
    bar.close()
    board.close()
    workers = straggler_totals(straggler, trained["s"], device)
    if workers is not None:
        writer.write({"kind": "straggler", "workers": workers})
    summary = summarize(config, steps, evals, world=world, n_params=n_params,
                        wall_s=time.perf_counter() - t_begin, device=str(device), optimizer=opt,
                        workers=workers)
    if rank == 0:
        write_csv([summary], os.path.join(config.out, "summary.csv"))
        if "local_steps_picked" in summary:
            print(f"[{config.label}] local_steps='auto' picked H={summary['local_steps_picked']}: a round's agreement "
                  f"~{1e3 * summary['round_s']:.1f} ms on the measured link (alpha {summary['link_alpha_s']:.2e} s, "
                  f"beta {summary['link_beta_s_per_bit']:.2e} s/bit), a step's compute {1e3 * summary['step_s']:.1f} ms, "
                  f"round_share {summary['round_share']}", flush=True)
    return summary


STRAGGLER_KEYS = ("factor", "pause_s", "every_s", "compute_s", "slept_s", "paused_s", "pauses", "train_s")
"""A worker's record of ``--slow-worker``/``--pause-worker``: :meth:`Straggler.totals` and its training seconds."""


def straggler_totals(straggler: Straggler | None, train_s: float, device=None) -> list[dict] | None:
    """Every rank's :meth:`Straggler.totals` and its training seconds ``train_s`` (an all-reduce: every rank calls
    it), in rank order; None without a straggler (no collective: the run's config is every rank's)."""
    if straggler is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    table = torch.zeros(world, len(STRAGGLER_KEYS), dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float({**straggler.totals(), "train_s": train_s}[k]) for k in STRAGGLER_KEYS],
                               dtype=torch.float64)
    comm.all_reduce(table)
    return [{"rank": r, **{k: (int(v) if k == "pauses" else v) for k, v in zip(STRAGGLER_KEYS, row)}}
            for r, row in enumerate(table.tolist())]


def _resume_path(config: TrainConfig, device: torch.device | None = None) -> str | None:
    """The checkpoint to continue from: ``resume``, else with ``auto_resume`` ``out``'s newest valid one
    (if any). Rank 0 decides (and warns about a corrupt newer checkpoint it skips); every rank gets its pick
    (a JSON broadcast on ``device``, the run's device)."""
    if config.resume:
        return checkpoint.find_checkpoint(config.resume)
    if not config.auto_resume:
        return None
    pick = checkpoint.latest_checkpoint(config.out) if dist.get_rank() == 0 else None
    return comm.broadcast_object(pick, device=device, src=0)


def summarize(config: TrainConfig, steps: list[dict], evals: list[dict], *, world: int, n_params: int,
              wall_s: float, device: str, optimizer=None, workers: list[dict] | None = None) -> dict:
    """One row per run: final losses and mean per-step costs (first 3 steps skipped as warm-up).

    With a LionCub ``optimizer``: ``vote_chosen`` (the method run, e.g. ``pbit/2b``; what
    ``vote='auto'`` picked) and ``skipped_steps`` (non-finite steps skipped). With LocalCub's ``aggregation='auto'``
    (``--local-setting link``): ``local_setting`` (``'lowbit'`` or ``'long'``, :mod:`lioncub.optim.regime`).
    With ``workers`` (:func:`straggler_totals`, a run with ``--slow-worker``/``--pause-worker``): ``stragglers`` (the
    flags) and per rank, ``;``-separated, ``worker_compute_s``, ``worker_slept_s`` (the slowdown) and
    ``worker_paused_s``."""
    timed = steps[3:] if len(steps) > 6 else steps

    def mean(key):
        return statistics.fmean(r[key] for r in timed) if timed else float("nan")

    rate_key = "tokens_per_s" if config.is_gpt else "images_per_s"
    row = {"label": config.label, "model": config.model, "optimizer": config.optimizer,
           "vote": config.vote if config.optimizer == "lioncub" else "grad(harness)",
           "bits": config.bits, "quantizer": config.quantizer, "world_size": world, "device": device,
           "params": n_params, "steps": steps[-1]["step"] if steps else 0,
           "final_train_loss": steps[-1]["loss"] if steps else float("nan"),
           "final_val_loss": evals[-1]["val_loss"] if evals else float("nan")}
    if evals and "val_acc" in evals[-1]:
        row["final_val_acc"] = evals[-1]["val_acc"]
    if isinstance(optimizer, (LionCub, NodeCub)):
        vote, bits = optimizer.vote_chosen
        if isinstance(optimizer, NodeCub):
            row.update(nodes=config.nodes, shard=config.shard)
        row.update(vote_chosen=f"{vote}/{bits}b" if bits else vote, skipped_steps=optimizer.skipped_steps,
                   momentum_sync=config.momentum_sync)
    pick = getattr(optimizer, "steps_pick", None)
    if pick and pick.get("setting"):  # LocalCub(aggregation='auto'): the setting it picked from the link
        row.update(local_setting=pick["setting"]["name"])
    if pick and pick.get("H") is not None:  # LocalCub(local_steps='auto'): what it picked, from what
        row.update(local_steps_picked=pick["H"], round_s=pick["round_s"], step_s=pick["step_s"],
                   link_alpha_s=pick["alpha"], link_beta_s_per_bit=pick["beta"], round_share=pick["round_share"])
    row.update({"bytes_sent_per_step": mean("bytes_sent"), "n_collectives_per_step": mean("n_collectives"),
                "t_step_ms": 1e3 * mean("t_step"), "t_compute_ms": 1e3 * mean("t_compute"),
                "t_vote_ms": 1e3 * mean("t_vote"), "t_other_ms": 1e3 * mean("t_other"),
                rate_key: mean(rate_key), "train_time_s": steps[-1]["train_time"] if steps else 0.0,
                "wall_s": wall_s, "run_dir": config.out})
    if workers is not None:
        row["stragglers"] = format_specs(config.slow_workers, config.pause_workers)
        for key in ("compute_s", "slept_s", "paused_s"):
            row[f"worker_{key}"] = ";".join(f"{w[key]:.3f}" for w in workers)
    return row
