"""Checkpoints: everything a resumed run needs to continue bit for bit.

Layout of ``RUN/ckpt/step_0000040/``::

    meta.json       step, world size, config, label, ``files``: the size and SHA-256 of
                    every other file, and ``meta_sha256``: the SHA-256 of the rest of
                    meta.json (written last, once every rank's file is on disk)
    model.pt        rank 0's parameters and buffers (parameters are identical on all ranks)
    rank{r}.pt      per rank: optimizer state (local momenta, step parity, quantizer RNG),
                    model buffers (e.g. BatchNorm statistics), data position, RNG states

``RUN/ckpt/latest`` names the newest complete checkpoint. A checkpoint is
written under a temporary name and renamed once every rank has written, so a
crash never leaves a half checkpoint as ``latest``. Multi-node runs need ``RUN``
on a shared file system.

Trust: every file is read with ``torch.load(weights_only=True)`` (tensors and plain
Python values only; RNG and loader states are stored as such), so a checkpoint from
someone else cannot run code; a file holding anything else is refused with
:class:`CheckpointError`. Each file is checked against ``meta.json``'s size and
checksum before it is unpickled. :func:`latest_checkpoint` (``--auto-resume``)
skips an incomplete or corrupt newest checkpoint with a warning naming it and
returns the newest valid one.

Resuming on another world size (:func:`load_checkpoint` reads every old
``rank{r}.pt``; same size: bit for bit, as above). The rules:

- optimizer: LionCub momenta via :func:`lioncub.engine.resume.reshard_states` (every new
  rank starts from the old ranks' mean momentum; step parity carries over). The
  ``pbit`` lane width and ``vote='auto'``'s pick are the new world's (the old
  width could overflow with more workers). Lion/AdamW state (identical on all
  ranks under the gradient allreduce): old rank 0's. LocalCub (``delay=1`` too) is
  refused in one line: its inner optimizer's moments, residuals and a round in
  progress are per worker, with no rule that would make them another world's.
- model buffers (BatchNorm statistics, per rank): floating ones averaged over the
  old ranks, the others (counters) from old rank 0.
- data position: the shards are re-cut for the new world, so a position cannot
  carry over window for window. Each new rank resumes at the same *fraction of an
  epoch* the old ranks had reached on average: ``e + f = mean_r(epoch_r +
  pos_r / epoch_len_r)``, then epoch ``e``, position ``round(f * epoch_len)`` of
  its own shard. About as much data as was consumed is skipped, but not the very
  windows (each epoch's order is a fresh permutation of the new shard).
- RNG (dropout masks): reseeded from ``(seed, rank, step)``, distinct per rank.

Devices: every file is read with ``map_location="cpu"``. RNG states are CPU byte tensors
(a CUDA generator's state too), which ``set_state`` and ``.numpy()`` need; the model's and the
optimizer's ``load_state_dict`` copy the rest onto the parameters' device. The collectives of
:func:`save_checkpoint` (barriers, the gathered file listing) run on the parameters' device
through :mod:`lioncub.comm`, as NCCL requires.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist

from .. import comm


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, or holds more than tensors and plain values."""


def rng_state() -> dict:
    """Every RNG's state as tensors and plain Python values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s states (its tensors are CPU tensors; moved there if not)."""
    torch.set_rng_state(state["torch"].cpu())
    n, py = state["numpy"], state["python"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def save_checkpoint(run_dir: str, step: int, *, model, optimizer, loader, meta: dict, keep: int = 2) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory.

    Its barriers and the gathered file listing run on the model's parameters' device."""
    rank = dist.get_rank()
    device = comm.device_of(model.parameters())
    root = os.path.join(run_dir, "ckpt")
    final = os.path.join(root, f"step_{step:07d}")
    tmp = os.path.join(root, f".step_{step:07d}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier(device=device)
    files = _write(tmp, f"rank{rank}.pt", {"optimizer": optimizer.state_dict(), "buffers": dict(model.named_buffers()),
                                           "loader": loader.state_dict(), "rng": rng_state()})
    if rank == 0:
        files.update(_write(tmp, "model.pt", model.state_dict()))
    gathered = comm.all_gather_object(files, device=device)  # after this every rank's file is on disk
    if rank == 0:
        listing = {name: entry for part in gathered for name, entry in sorted(part.items())}
        record = {"step": step, "world_size": dist.get_world_size(), **meta, "files": listing}
        record["meta_sha256"] = _meta_digest(record)
        with open(os.path.join(tmp, "meta.json"), "w") as f:  # last: its presence means complete
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    comm.barrier(device=device)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(os.path.basename(final) + "\n")
        old = sorted(d for d in os.listdir(root) if d.startswith("step_"))[:-keep]
        for d in old:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    comm.barrier(device=device)
    return final


def _write(directory: str, name: str, obj) -> dict:
    """Save ``obj`` as ``directory/name``; returns ``{name: {"bytes", "sha256"}}`` for meta.json."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def find_checkpoint(path: str) -> str:
    """A checkpoint directory from ``path``: itself, or a run directory's latest checkpoint."""
    if any(os.path.exists(os.path.join(path, f)) for f in ("meta.json", "model.pt")):
        return path  # a checkpoint directory (complete or not: verify_checkpoint / read_meta say)
    latest = os.path.join(path, "ckpt", "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(path, "ckpt", f.read().strip())
    raise ValueError(f"{path!r} is neither a checkpoint directory nor a run directory with ckpt/latest")


def read_meta(ckpt_dir: str) -> dict:
    """``meta.json``, checked to list every file with its size and checksum (else CheckpointError)."""
    path = os.path.join(ckpt_dir, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}): the checkpoint is corrupt") from None
    if not isinstance(meta, dict) or "meta_sha256" not in meta or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} lists no file checksums: the checkpoint is corrupt or was written by "
                              "a lioncub before checksums")
    if meta["meta_sha256"] != _meta_digest(meta):
        raise CheckpointError(f"{path} is corrupt: its content does not match its own SHA-256 (meta_sha256)")
    return meta


def _meta_digest(meta: dict) -> str:
    """SHA-256 of meta.json's content without its own ``meta_sha256`` field (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _check(path: str, entry: dict, size: int, sha256: str) -> None:
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} is truncated or corrupt: {size} bytes, meta.json says {entry['bytes']}")
    if sha256 != entry["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 differs from meta.json's")


def read_file(ckpt_dir: str, name: str, meta: dict, map_location="cpu"):
    """One checkpoint file: its size and SHA-256 checked against ``meta``, then unpickled with
    ``weights_only=True`` (tensors and plain Python values only). Raises CheckpointError naming the file.
    Tensors land on ``map_location`` (CPU by default: RNG states must stay CPU tensors)."""
    path = os.path.join(ckpt_dir, name)
    entry = meta["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in meta.json")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"{path} is missing or unreadable ({exc.strerror})") from None
    _check(path, entry, len(data), hashlib.sha256(data).hexdigest())
    return _unpickle(path, io.BytesIO(data), map_location=map_location)


def _unpickle(path: str, source, **kwargs):
    """``torch.load(source, weights_only=True)``; a file holding anything else is refused, naming ``path``."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported[^.]*", str(exc))  # e.g. "Unsupported global: GLOBAL builtins.exec ..."
        reason = found.group(0) if found else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{path} was refused: it holds more than tensors and plain Python values, so "
                              f"loading it could run code (torch.load weights_only=True: {reason})") from None
    except (RuntimeError, EOFError) as exc:  # a valid checksum over a file torch cannot read
        raise CheckpointError(f"{path} is not a torch checkpoint file ({str(exc).splitlines()[0]})") from None


def verify_checkpoint(ckpt_dir: str) -> dict:
    """Check every file of a checkpoint against meta.json (size and SHA-256) and that it unpickles
    with ``weights_only=True`` (memory-mapped: the tensors are not read); returns meta."""
    meta = read_meta(ckpt_dir)
    for name, entry in meta["files"].items():
        path = os.path.join(ckpt_dir, name)
        digest, size = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise CheckpointError(f"{path} is missing or unreadable ({exc.strerror})") from None
        _check(path, entry, size, digest.hexdigest())
        _unpickle(path, path, mmap=True, map_location="cpu")
    return meta


def latest_checkpoint(run_dir: str) -> str | None:
    """``run_dir``'s newest valid checkpoint, or None when it has none (``--auto-resume``).

    A newer checkpoint that is incomplete or corrupt (a node died while writing it, a full
    disk) is skipped with a warning naming it."""
    root = os.path.join(run_dir, "ckpt")
    names = sorted((d for d in os.listdir(root) if d.startswith("step_")), reverse=True) if os.path.isdir(root) else []
    for name in names:
        try:
            verify_checkpoint(os.path.join(root, name))
            return os.path.join(root, name)
        except CheckpointError as exc:
            warnings.warn(f"auto-resume: skipping checkpoint {os.path.join(root, name)}: {exc}", stacklevel=2)
    return None


def load_checkpoint(ckpt_dir: str, *, model, optimizer, loader, device=None, seed: int = 0) -> dict:
    """Restore this rank's state in place; returns meta (``meta['step']`` steps are done).

    A checkpoint from another world size is re-sharded (rules in the module docstring);
    ``meta['resharded_from']`` then holds the saved world size.

    Files are read onto the CPU (``map_location="cpu"``): RNG states stay CPU tensors, and
    ``model.load_state_dict`` / ``optimizer.load_state_dict`` / the buffer copies move the
    rest onto the parameters' device. ``device`` (kept for callers) is not needed for that."""
    meta = read_meta(ckpt_dir)
    rank, world, old_world = dist.get_rank(), dist.get_world_size(), meta["world_size"]
    # assign=False (the default): copied into the existing parameters, which stay on their device
    model.load_state_dict(read_file(ckpt_dir, "model.pt", meta, "cpu"))
    if old_world == world:
        rank_state = read_file(ckpt_dir, f"rank{rank}.pt", meta, "cpu")
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(rank_state["buffers"][name])
        optimizer.load_state_dict(rank_state["optimizer"])
        loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        return meta
    old = [read_file(ckpt_dir, f"rank{r}.pt", meta, "cpu") for r in range(old_world)]
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
    if "nodecub" in states[0]:
        raise ValueError(f"--resume: this checkpoint was saved by a --nodes run of {len(states)} ranks; it resumes "
                         f"on {len(states)} ranks in the same nodes only (this run has {world})")
    if "local" in states[0]:
        raise ValueError(f"--resume: this checkpoint was saved by LocalCub on {len(states)} workers and this run has "
                         f"{world}: LocalCub's per-worker state (its inner optimizer's moments, error-feedback "
                         f"residuals, a round in progress) does not reshard; resume it on {len(states)} workers")
    if "lioncub" not in states[0]:
        return states[0]  # Lion / AdamW under a gradient allreduce: the same state on every rank
    from .. import votes
    from ..engine.resume import reshard_states

    sd = reshard_states(states, world)[rank]
    extra = sd["lioncub"]["config"]
    # 'auto' picks again for this world, and a method with lanes may pick another lane width for it
    lanes = (optimizer.vote == extra["vote"] and extra["vote"] in votes.METHODS
             and bool(votes.lookup(extra["vote"]).LANE_BITS))
    if sd["lioncub"].get("vote_requested") == "auto" or (lanes and extra["bits"] != optimizer.bits):
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
