"""Checkpoints: everything a resumed run needs to continue bit for bit.

Layout of ``RUN/ckpt/step_0000040/``::

    meta.json       step, world size, config, label
    model.pt        rank 0's parameters and buffers (parameters are identical on all ranks)
    rank{r}.pt      per rank: optimizer state (local momenta, step parity, quantizer RNG),
                    model buffers (e.g. BatchNorm statistics), data position, RNG states

``RUN/ckpt/latest`` names the newest complete checkpoint. A checkpoint is
written under a temporary name and renamed once every rank has written, so a
crash never leaves a half checkpoint as ``latest``. Multi-node runs need ``RUN``
on a shared file system.

Resuming on another world size (:func:`load_checkpoint` reads every old
``rank{r}.pt``; same size: bit for bit, as above). The rules:

- optimizer: LionCub momenta via :func:`lioncub.resume.reshard_states` (every new
  rank starts from the old ranks' mean momentum; step parity carries over). The
  ``pbit`` lane width and ``vote='auto'``'s pick are the new world's (the old
  width could overflow with more workers). Lion/AdamW state (identical on all
  ranks under the gradient allreduce): old rank 0's.
- model buffers (BatchNorm statistics, per rank): floating ones averaged over the
  old ranks, the others (counters) from old rank 0.
- data position: the shards are re-cut for the new world, so a position cannot
  carry over window for window. Each new rank resumes at the same *fraction of an
  epoch* the old ranks had reached on average: ``e + f = mean_r(epoch_r +
  pos_r / epoch_len_r)``, then epoch ``e``, position ``round(f * epoch_len)`` of
  its own shard. About as much data as was consumed is skipped, but not the very
  windows (each epoch's order is a fresh permutation of the new shard).
- RNG (dropout masks): reseeded from ``(seed, rank, step)``, distinct per rank.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: str, step: int, *, model, optimizer, loader, meta: dict, keep: int = 2) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory."""
    rank = dist.get_rank()
    root = os.path.join(run_dir, "ckpt")
    final = os.path.join(root, f"step_{step:07d}")
    tmp = os.path.join(root, f".step_{step:07d}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    torch.save({"optimizer": optimizer.state_dict(), "buffers": dict(model.named_buffers()),
                "loader": loader.state_dict(), "rng": rng_state()}, os.path.join(tmp, f"rank{rank}.pt"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size(), **meta}, f, indent=1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(os.path.basename(final) + "\n")
        old = sorted(d for d in os.listdir(root) if d.startswith("step_"))[:-keep]
        for d in old:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(path: str) -> str:
    """A checkpoint directory from ``path``: itself, or a run directory's latest checkpoint."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "ckpt", "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(path, "ckpt", f.read().strip())
    raise ValueError(f"resume: {path!r} is neither a checkpoint directory nor a run directory with ckpt/latest")


def _read_meta(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        return json.load(f)


def latest_checkpoint(run_dir: str) -> str | None:
    """``run_dir``'s newest complete checkpoint, or None when it has none (``--auto-resume``)."""
    try:
        return find_checkpoint(run_dir)
    except ValueError:
        return None


def load_checkpoint(ckpt_dir: str, *, model, optimizer, loader, device, seed: int = 0) -> dict:
    """Restore this rank's state in place; returns meta (``meta['step']`` steps are done).

    A checkpoint from another world size is re-sharded (rules in the module docstring);
    ``meta['resharded_from']`` then holds the saved world size."""
    meta = _read_meta(ckpt_dir)
    rank, world, old_world = dist.get_rank(), dist.get_world_size(), meta["world_size"]
    model.load_state_dict(torch.load(os.path.join(ckpt_dir, "model.pt"), map_location=device))
    if old_world == world:
        rank_state = torch.load(os.path.join(ckpt_dir, f"rank{rank}.pt"), map_location=device, weights_only=False)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(rank_state["buffers"][name])
        optimizer.load_state_dict(rank_state["optimizer"])
        loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        return meta
    old = [torch.load(os.path.join(ckpt_dir, f"rank{r}.pt"), map_location=device, weights_only=False)
           for r in range(old_world)]
    with torch.no_grad():
        for name, buf in model.named_buffers():
            saved = [s["buffers"][name] for s in old]
            buf.copy_(torch.stack(saved).double().mean(0) if buf.is_floating_point() else saved[0])
    optimizer.load_state_dict(reshard_optimizer([s["optimizer"] for s in old], optimizer, rank, world))
    reshard_loader([s["loader"] for s in old], loader)
    torch.manual_seed(seed + 1000 + rank + 7919 * meta["step"])
    np.random.seed((seed + rank + 7919 * meta["step"]) % 2**32)
    random.seed(seed + rank + 7919 * meta["step"])
    return {**meta, "resharded_from": old_world}


def reshard_optimizer(states: list[dict], optimizer, rank: int, world: int) -> dict:
    """This rank's optimizer state dict out of the old ranks' ``states`` (see the module docstring)."""
    if "lioncub" not in states[0]:
        return states[0]  # Lion / AdamW under a gradient allreduce: the same state on every rank
    from ..resume import reshard_states

    sd = reshard_states(states, world)[rank]
    extra = sd["lioncub"]
    if extra.get("vote_requested") == "auto" or (optimizer.vote == extra["vote"] == "pbit" and
                                                 extra["bits"] != optimizer.bits):
        extra["vote"], extra["bits"] = optimizer.vote, optimizer.bits  # this world's pick / lane width
    return sd


def reshard_loader(states: list[dict], loader) -> None:
    """Position ``loader`` (this rank's new shard) at the old ranks' mean epoch progress."""
    if not all("epoch_len" in s for s in states):  # checkpoints before epoch_len was saved
        loader.load_state_dict(states[0])
        return
    progress = sum(s["epoch"] + s["pos"] / max(1, s["epoch_len"]) for s in states) / len(states)
    epoch = int(progress)
    loader.load_state_dict({"epoch": epoch, "pos": 0})
    n = loader.state_dict()["epoch_len"]
    loader.load_state_dict({"epoch": epoch, "pos": min(n, round((progress - epoch) * n))})
