"""The every-step message of a method that sends a compressed mean (``shared_momentum``: the 1-bit
mean, :mod:`lioncub.votes.mean`): encode the innovations ``g − m`` with the method's residuals, its two
collectives (the two-phase mean, :mod:`lioncub.votes.twophase`), decode ``ĝ`` and run Lion on it with the
momentum every rank shares. A step of
:class:`~lioncub.engine.step.BucketStep` (its buffers, momenta, residuals and chunk-owner state), torch ops."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..lion import lion

__all__ = ["mean_message", "shapes"]
# ``run`` below is the BucketStep of engine/step.py, ``parts`` / ``buckets`` its Buckets (not imported:
# step.py calls in here, and this module stays below it).


def mean_message(run, parts: list, msg: list[int], buckets: list, stats: CommStats, step: int) -> None:
    """``aggregate='mean'``: one message's buckets through the 1-bit compressed mean, then Lion
    on ĝ with the shared momentum (:mod:`lioncub.votes.mean`; torch ops)."""
    method = run.method
    nbs = [method.part_nbytes(b.numel) for b in parts]
    m, device = sum(nbs), parts[0].device
    buf = run.buffer("msg", method.message_nbytes(m), torch.uint8, device)
    buf[m:].zero_()
    shape = run.buffer("shape", 8 * method.message_nbytes(m), torch.float32, device)
    shape.zero_()  # h of the message's elements (padding 0)
    alphas, tensors, offset = [], [], 0
    residual = run.owners.get(method, buckets, msg, m, device)
    if step == method.restart > 0:  # the momentum and both residuals restart; h is kept
        for t in [t for bucket in parts for t in run.momenta(bucket) + run.residuals(bucket)] + [residual]:
            t.zero_()
    for bucket, nb in zip(parts, nbs):
        exp_avgs, grads = run.momenta(bucket), run.grads(bucket)
        t0 = comm.clock(stats)
        v = run.buffer("c", bucket.numel, torch.float32, device)
        for piece, g, e, (group, _) in zip(v.split(bucket.sizes), grads, exp_avgs, bucket.entries):
            torch.sub(g.neg() if group["maximize"] else g, e, out=piece.view_as(g))  # δ = g − m
        start = 8 * offset
        for n, signed in zip(bucket.sizes, shapes(run, bucket)):
            tensors.append((start, n))
            torch.abs(signed.reshape(-1), out=shape[start:start + n])
            start += n
        h = shape[8 * offset:8 * offset + bucket.numel]
        alphas.append(method.encode_mean(v, buf[offset:offset + nb], step, bucket.sizes, run.residuals(bucket),
                                         h))
        offset += nb
        stats.t_quantize_pack += comm.clock(stats) - t0
    two, got = method.exchange_mean(buf, m, torch.cat(alphas), tensors, step, run.group, stats, residual, shape)
    offset = 0
    for bucket, nb in zip(parts, nbs):
        t0 = comm.clock(stats)
        ghat = two.decode(got, 8 * offset, bucket.numel, run.buffer("c", bucket.numel, torch.float32, device))
        params, exp_avgs = bucket.params, run.momenta(bucket)
        for piece, signed in zip(ghat.split(bucket.sizes), shapes(run, bucket)):
            method.adapt_shape_(signed.view(-1), piece)
        grads = [piece.view_as(p).add_(e).to(p.dtype) for piece, p, e in zip(ghat.split(bucket.sizes), params,
                                                                               exp_avgs)]  # ĝ = m + β·h·τ
        stats.t_unpack_vote += comm.clock(stats) - t0
        t0 = comm.clock(stats)
        for g, ks in bucket.runs:
            lion([params[k] for k in ks], [grads[k] for k in ks], [exp_avgs[k] for k in ks], lr=g["lr"],
                 beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=g["weight_decay"], maximize=False,
                 foreach=True)
        stats.t_apply += comm.clock(stats) - t0
        offset += nb


def shapes(run, bucket) -> list[Tensor]:
    """``aggregate='mean'``: each parameter's shared magnitudes with the last decoded signs,
    ``h·τ`` (``state['mean_shape']``, fp32, all +1 the first time: :mod:`lioncub.votes.mean`)."""
    out = []
    for p in bucket.params:
        state = run.state[p]
        if "mean_shape" not in state:
            state["mean_shape"] = torch.ones_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        out.append(state["mean_shape"])
    return out
