"""Throughput of the vote's local stages on CPU against a plain copy of the same bytes.

Stages (n elements, P ranks, one thread):

    quantize+pack  c (fp32, 4n B) -> signs -> 1-bit packed (n/8 B)        [gather/onebit]
    quantize+pack  c (fp32, 4n B) -> {0,1} -> 4-bit lanes (n/2 B)         [pbit]
    unpack+vote    P x n/8 B packed signs -> counts -> u (int8, n B)       [gather]
    unpack+vote    n/2 B lane sums -> u (int8, n B)                         [pbit]

GB/s is counted on the larger side of each stage (4n B in, or n B out for the
votes); "copy" copies that many bytes (``dst.copy_(src)``, preallocated), the
memory-bandwidth yardstick. "old" is the pre-kernel implementation (shift + sum
over lanes, int16 counts), kept here only as the baseline.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 bench/kernels.py [--mib 64] [--world 4]
Writes bench/results/kernels.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lioncub import kernels
from lioncub.vote import binary_signs, decide


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


def _time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=64, help="size of c in MiB of fp32")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n, P = int(a.mib * 2**20) // 4, a.world
    c = torch.randn(n)
    packed_all = torch.stack([kernels.pack_bytes(kernels.sign_bits(torch.randn(n), 0), n, 1) for _ in range(P)])
    lanes = kernels.pack_bytes(torch.randint(0, P + 1, (n,), dtype=torch.uint8), n, 4)
    big_src, big_dst = torch.empty(4 * n, dtype=torch.uint8), torch.empty(4 * n, dtype=torch.uint8)
    small_src, small_dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    stages = {
        "quantize+pack 1-bit": (4 * n, lambda: kernels.pack_bytes(kernels.sign_bits(c, 0), n, 1),
                                lambda: _old_pack(binary_signs(c, 0).to(torch.uint8), 1)),
        "quantize+pack 4-bit": (4 * n, lambda: kernels.pack_bytes(kernels.sign_bits(c, 0), n, 4),
                                lambda: _old_pack(binary_signs(c, 0).to(torch.uint8), 4)),
        "unpack+vote 1-bit x P": (n, lambda: kernels.decide_counts(kernels.count_bits(packed_all, n), P, 0, ties="zero"),
                                  lambda: decide(_old_unpack(packed_all.reshape(-1), P * n, 1).view(P, n)
                                                 .sum(0, dtype=torch.int16), P, 0, ties="zero")),
        "unpack+vote 4-bit": (n, lambda: kernels.decide_counts(kernels.unpack_bytes(lanes, n, 4), P, 0, ties="zero"),
                              lambda: decide(_old_unpack(lanes, n, 4).to(torch.int16), P, 0, ties="zero")),
    }
    copy_big = _time(lambda: big_dst.copy_(big_src), a.repeats)
    copy_small = _time(lambda: small_dst.copy_(small_src), a.repeats)
    rows = []
    print(f"n = {n:,} elements ({a.mib:g} MiB fp32), P = {P}, 1 thread")
    print(f"{'stage':24s} {'GB/s':>7s} {'old GB/s':>9s} {'copy GB/s':>10s} {'% of copy':>10s} {'x old':>6s}")
    for name, (nbytes, new, old) in stages.items():
        t_new, t_old = _time(new, a.repeats), _time(old, max(2, a.repeats // 2))
        t_copy = copy_big if nbytes == 4 * n else copy_small
        row = dict(stage=name, bytes=nbytes, gbps=nbytes / t_new / 1e9, old_gbps=nbytes / t_old / 1e9,
                   copy_gbps=nbytes / t_copy / 1e9, frac_of_copy=t_copy / t_new, speedup=t_old / t_new)
        rows.append(row)
        print(f"{name:24s} {row['gbps']:7.2f} {row['old_gbps']:9.2f} {row['copy_gbps']:10.2f} "
              f"{100 * row['frac_of_copy']:9.0f}% {row['speedup']:6.1f}")
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/kernels.json", "w") as f:
        json.dump(dict(n=n, world=P, threads=1, rows=rows, load=os.getloadavg()), f, indent=1)


if __name__ == "__main__":
    main()
