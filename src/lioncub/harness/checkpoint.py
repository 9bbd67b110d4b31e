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


def load_checkpoint(ckpt_dir: str, *, model, optimizer, loader, device) -> dict:
    """Restore this rank's state in place; returns meta (``meta['step']`` steps are done)."""
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        meta = json.load(f)
    world = dist.get_world_size()
    if meta["world_size"] != world:
        raise ValueError(f"resume: checkpoint has world size {meta['world_size']} but this run has {world}; "
                         "momenta are per rank, so the world size must match")
    rank_state = torch.load(os.path.join(ckpt_dir, f"rank{dist.get_rank()}.pt"), map_location=device,
                            weights_only=False)
    model.load_state_dict(torch.load(os.path.join(ckpt_dir, "model.pt"), map_location=device))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(rank_state["buffers"][name])
    optimizer.load_state_dict(rank_state["optimizer"])
    loader.load_state_dict(rank_state["loader"])
    set_rng_state(rank_state["rng"])
    return meta
