"""Throughput of the vote's local stages on CPU against a plain copy of the same bytes.

Stages (n elements, P ranks, one thread):

    quantize+pack  c (fp32, 4n B) -> signs -> 1-bit packed (n/8 B)        [gather/onebit]
    quantize+pack  c (fp32, 4n B) -> {0,1} -> 4-bit lanes (n/2 B)         [pbit]
    vote 1-bit x P   P x n/8 B packed signs -> u (int8 n B | fp32 4n B)      [gather]
    onebit vote      P x n/(8P) B -> voted bits n/(8P) B (rank's chunk)      [onebit]
    onebit unpack    n/8 B voted bits -> u (int8 n B | fp32 4n B)            [onebit]
    vote 4-bit       n/2 B lane sums -> u (int8 n B | fp32 4n B)             [pbit]
    fused encode     m, g (2 x 4n B) -> packed signs of c, c never stored    [lioncub.fused]
    fused apply      voted bits or int8 u -> p, m updated (4 x 4n B moved)   [lioncub.fused]
    fused c          m, g -> c (fp32, 4n B), gradients checked finite        [lioncub.fused]
    fused L1 lanes   c -> 8-bit lanes of round(c·s/‖c‖₁·n) + s (n B)         [lioncub.fused]

(for the fused rows "old" is the torch ops they replace: interpolate + sign_bits + pack;
unpack to fp32 + apply_update_; interpolate; quantize(c, 'l1') + q + s + pack. The L1 lanes
rows include the norm, |c| into a kept buffer and its mean, in both columns.)

GB/s is counted on the largest buffer a stage reads or writes; "copy" copies that
many bytes (``dst.copy_(src)``, preallocated; the same size, not a smaller cache-resident
one), the memory-bandwidth yardstick. Times are the best of ``--repeats`` in thread CPU
time (the shared host runs at load 10-30). "old" is the previous implementation:
for pack the pre-kernel shift + sum over lanes; for the votes the table kernels
(``index_select`` unpack, uint8 counts, torch comparisons, ``.to(fp32)``) that the
word votes (bit-sliced counter, SWAR compare, embedding decode) replaced, kept here as
the ``_old_*`` functions.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 bench/kernels.py [--mib 64] [--world 4]
Writes bench/results/kernels.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lioncub import fused
from lioncub.wire import kernels
from lioncub.lion import apply_update_, interpolate
from lioncub import votes
from lioncub.votes import binary_signs


def _old_pack(values, bits):
    per = 8 // bits
    n = values.numel()
    nb = -(-n // per)
    padded = torch.zeros(nb * per, dtype=torch.uint8)
    padded[:n] = values
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (padded.view(nb, per) << shifts).sum(dim=1, dtype=torch.uint8)


def _old_unpack(packed, n, bits):
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


def _old_unpack_pm1(packed, n):
    idx = packed.reshape(-1).to(torch.int32)
    return torch.index_select(kernels._table(1, "pm1", "cpu"), 0, idx).view(torch.int8)[:n]


def _old_count(packed, n):
    """Per element, how many of the P rows of packed sign bits have it set (uint8, P ≤ 255):
    each row unpacked by the 256-word table, the rows' words summed as int64 (8 byte counters)."""
    idx = packed.reshape(-1).to(torch.int32)
    words = torch.index_select(kernels._table(1, "lanes", "cpu"), 0, idx).view(packed.shape[0], -1)
    total = words[0].clone()
    for row in words[1:]:
        total += row
    return total.view(torch.uint8)[:n]


def _old_decide(count, world):
    """``sign(2k − P)`` as int8 from uint8 counts by two torch comparisons (ties → 0)."""
    return (count > world // 2).view(torch.int8) - (count < (world + 1) // 2).view(torch.int8)


def _old_majority(packed, n, world):
    """The 1-bit vote of an even step, packed: 2k ≥ P by one comparison of the counts."""
    return kernels.pack_bytes(_old_count(packed, n) >= (world + 1) // 2, n, 1)


def _time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def table(res: dict) -> str:
    """The stages' GB/s against a copy of their largest buffer, from ``main``'s JSON."""
    lines = [f"n = {res['n']:,} elements ({res['n'] * 4 / 2**20:g} MiB fp32), P = {res['world']}, "
             f"{res['threads']} thread, load {res['load'][0]:.1f}",
             f"{'stage':24s} {'MB':>6s} {'GB/s':>7s} {'old GB/s':>9s} {'copy GB/s':>10s} {'% of copy':>10s} "
             f"{'old %':>6s} {'x old':>6s}"]
    for row in res["rows"]:
        lines.append(f"{row['stage']:24s} {row['bytes'] / 1e6:6.1f} {row['gbps']:7.2f} {row['old_gbps']:9.2f} "
                     f"{row['copy_gbps']:10.2f} {100 * row['frac_of_copy']:9.0f}% {100 * row['old_frac_of_copy']:5.0f}% "
                     f"{row['speedup']:6.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=64, help="size of c in MiB of fp32")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/kernels.json", help="JSON output path")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        with open(a.report_only) as f:
            print(table(json.load(f)))
        return
    torch.set_num_threads(1)
    n, P = int(a.mib * 2**20) // 4, a.world
    f32 = torch.float32
    c = torch.randn(n)
    packed_all = torch.stack([kernels.pack_bytes(kernels.sign_bits(torch.randn(n), 0), n, 1) for _ in range(P)])
    chunk = -(-n // (8 * P)) * 8
    mine = packed_all[:, : chunk // 8].contiguous()  # (P, chunk/8): every rank's bits of one chunk
    voted = kernels.majority_bits(packed_all.reshape(-1)[: n // 8].view(1, -1), 1, 0)  # n/8 B of bits
    lanes = kernels.pack_bytes(torch.randint(0, P + 1, (n,), dtype=torch.uint8), n, 4)

    def gather_new(dtype):
        gt, eq = kernels.vote_bits(packed_all, P)
        return kernels.spread_votes(gt, ~(gt | eq), n, dtype)

    old_gather = lambda: _old_decide(_old_count(packed_all, n), P)  # noqa: E731
    old_lanes = lambda: _old_decide(kernels.unpack_bytes(lanes, n, 4), P)  # noqa: E731
    stages = {  # name: (bytes of the largest buffer, new, old)
        "quantize+pack 1-bit": (4 * n, lambda: kernels.pack_bytes(kernels.sign_bits(c, 0), n, 1),
                                lambda: _old_pack(binary_signs(c, 0).to(torch.uint8), 1)),
        "quantize+pack 4-bit": (4 * n, lambda: kernels.pack_bytes(kernels.sign_bits(c, 0), n, 4),
                                lambda: _old_pack(binary_signs(c, 0).to(torch.uint8), 4)),
        "vote 1-bit x P -> int8": (n, lambda: gather_new(torch.int8), old_gather),
        "vote 1-bit x P -> fp32": (4 * n, lambda: gather_new(f32), lambda: old_gather().to(f32)),
        "onebit vote (chunk)": (P * chunk // 8, lambda: kernels.majority_bits(mine, P, 0),
                                lambda: _old_majority(mine, chunk, P)),
        "onebit unpack -> int8": (n, lambda: kernels.unpack_pm1(voted, n), lambda: _old_unpack_pm1(voted, n)),
        "onebit unpack -> fp32": (4 * n, lambda: kernels.unpack_pm1(voted, n, f32),
                                  lambda: _old_unpack_pm1(voted, n).to(f32)),
        "vote 4-bit -> int8": (n, lambda: kernels.vote_lanes(lanes, n, 4, P // 2, (P + 1) // 2), old_lanes),
        "vote 4-bit -> fp32": (4 * n, lambda: kernels.vote_lanes(lanes, n, 4, P // 2, (P + 1) // 2, f32),
                               lambda: old_lanes().to(f32)),
    }
    if fused.available():  # the fused loops against the torch ops they replace (same results)
        m, g, prm, cbuf = torch.randn(n), torch.randn(n), torch.randn(n), torch.empty(n)
        bits1, bits4 = torch.empty(-(-n // 8), dtype=torch.uint8), torch.empty(-(-n // 2), dtype=torch.uint8)
        u8 = torch.randint(-1, 2, (n,), dtype=torch.int8)
        upd = dict(lr=1e-12, beta2=0.99, weight_decay=0.0)

        codec8 = votes.make("pbit", P, 8, "l1")
        lanes8, work = torch.empty(codec8.part_nbytes(n), dtype=torch.uint8), torch.empty(n)
        cq = torch.randn(n)

        def l1_lanes(use_fused):
            codec8.encode(cq, lanes8, 0, work=work, use_fused=use_fused)

        def torch_encode(bits):
            interpolate([m], [g], 0.9, out=[cbuf])
            return kernels.pack_bytes(kernels.sign_bits(cbuf, 0), n, bits)

        stages.update({
            "fused encode m,g -> 1-bit": (4 * n, lambda: fused.encode([m], [g], 0.9, False, bits1, bits=1, step=0),
                                          lambda: torch_encode(1)),
            "fused encode m,g -> 4-bit": (4 * n, lambda: fused.encode([m], [g], 0.9, False, bits4, bits=4, step=0),
                                          lambda: torch_encode(4)),
            "fused apply from bits": (4 * n, lambda: fused.apply_bits([prm], [m], [g], voted, **upd),
                                      lambda: apply_update_([prm], [kernels.unpack_pm1(voted, n, f32, out=cbuf)], [m],
                                                            [g], foreach=True, **upd)),
            "fused apply from int8 u": (4 * n, lambda: fused.apply([prm], [m], [g], u8, **upd),
                                        lambda: apply_update_([prm], [cbuf.copy_(u8)], [m], [g], foreach=True, **upd)),
            "fused c m,g -> fp32": (4 * n, lambda: fused.interpolate([m], [g], 0.9, False, cbuf),
                                    lambda: interpolate([m], [g], 0.9, out=[cbuf])),
            "fused L1 lanes c -> 8-bit": (4 * n, lambda: l1_lanes(True), lambda: l1_lanes(False)),
        })
    copies = {}
    for nbytes, _, _ in stages.values():  # copy yardstick of each stage's largest buffer
        if nbytes not in copies:
            src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            copies[nbytes] = _time(lambda: dst.copy_(src), a.repeats)
    rows = []
    for name, (nbytes, new, old) in stages.items():
        t_new, t_old = _time(new, a.repeats), _time(old, max(2, a.repeats // 2))
        t_copy = copies[nbytes]
        row = dict(stage=name, bytes=nbytes, gbps=nbytes / t_new / 1e9, old_gbps=nbytes / t_old / 1e9,
                   copy_gbps=nbytes / t_copy / 1e9, frac_of_copy=t_copy / t_new,
                   old_frac_of_copy=t_copy / t_old, speedup=t_old / t_new)
        rows.append(row)
        print(f"{name}: {row['gbps']:.2f} GB/s", flush=True)
    res = dict(n=n, world=P, threads=1, rows=rows, load=os.getloadavg())
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
