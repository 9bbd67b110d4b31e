"""The bandwidth check of ``make gpu-check`` (tests/gpu/gpu_check.py): each Triton kernel's
GB/s (bytes read + written) on one large tensor, against a device copy of the same bytes and
against the torch path of the same pass. It fails when a kernel moves its bytes at under
:data:`FLOOR` of the copy's rate (:func:`judge`); the dry run's interpreted kernels are
measured but not judged."""
from __future__ import annotations

import statistics
import time


def _time(fn, sync, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after 2 warm-ups."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FLOOR = 0.25
"""The least fraction of a device copy's GB/s a kernel must reach: each pass reads and writes its
tensors once, as the copy does, so a memory-bound kernel runs near the copy's rate; a quarter of it
means a kernel gone wrong (serialised, uncoalesced, or launched per element), not a slow GPU."""


def judge(rows: list[dict], floor: float = FLOOR) -> dict:
    """``ok`` and the rows under ``floor`` of the copy's rate (``of_copy``: copy time / kernel time)."""
    slow = [r["kernel"] for r in rows if not r["of_copy"] >= floor]
    return dict(ok=bool(rows) and not slow, floor=floor, below_floor=slow)


def check_bandwidth(device: str, n: int, reps: int, judged: bool = True) -> dict:
    import torch
    from lioncub.wire import kernels
    from lioncub.fused import triton as tk
    from lioncub.lion import apply_update_, interpolate
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    p, m, g = (torch.randn(n, device=device, generator=gen) for _ in range(3))
    c = torch.randn(n, device=device, generator=gen)
    b1 = torch.empty(n // 8, dtype=torch.uint8, device=device)
    b4 = torch.empty(n // 2, dtype=torch.uint8, device=device)
    i8 = torch.randint(-1, 2, (n,), dtype=torch.int8, device=device)
    hp = dict(lr=1e-4, beta2=0.99, weight_decay=0.1)
    rows = [  # name, kernel call, bytes read + written, the torch path's call for the same pass
        ("encode 1-bit signs", lambda: tk.encode([m], [g], 0.9, False, b1, bits=1, step=0), 8 * n + n // 8,
         lambda: kernels.pack_bytes(kernels.sign_bits(interpolate([m], [g], 0.9)[0], 0), n, 1)),
        ("encode 4-bit lanes", lambda: tk.encode([m], [g], 0.9, False, b4, bits=4, step=1), 8 * n + n // 2,
         lambda: kernels.pack_bytes(kernels.sign_bits(interpolate([m], [g], 0.9)[0], 1), n, 4)),
        ("encode int8 signs", lambda: tk.encode([m], [g], 0.9, False, i8.view(torch.uint8), bits=8, step=0, signs=True),
         9 * n, lambda: torch.sign(interpolate([m], [g], 0.9)[0]).to(torch.int8)),
        ("interpolate c", lambda: tk.interpolate([m], [g], 0.9, False, c), 12 * n,
         lambda: interpolate([m], [g], 0.9)),
        ("quantize 4-bit lanes", lambda: tk.quantize_lanes(c, 3.0, 7, 4, b4), 4 * n + n // 2,
         lambda: kernels.pack_bytes(torch.round(c * 3.0).clamp_(-7, 7).to(torch.int8).view(torch.uint8) + 7, n, 4)),
        ("apply int8 u", lambda: tk.apply([p], [m], [g], i8, **hp), 21 * n,
         lambda: apply_update_([p], [i8.float()], [m], [g], foreach=True, **hp)),
        ("apply 1-bit votes", lambda: tk.apply_bits([p], [m], [g], b1, **hp), 20 * n + n // 8,
         lambda: apply_update_([p], [kernels.unpack_pm1(b1, n, torch.float32)], [m], [g], foreach=True, **hp)),
        ("apply 4-bit lane sums", lambda: tk.apply_lanes([p], [m], [g], b4, 4, 1, 2, **hp), 20 * n + n // 2,
         lambda: apply_update_([p], [kernels.vote_lanes(b4, n, 4, 1, 2, torch.float32)], [m], [g], foreach=True, **hp)),
    ]
    out = []
    for name, call, nbytes, torch_call in rows:
        t = _time(call, sync, reps)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t_copy = _time(lambda: dst.copy_(src), sync, reps)
        src = dst = None  # free them (the lambda above reads these names)
        t_torch = _time(torch_call, sync, max(reps // 2, 1))
        out.append(dict(kernel=name, elements=n, bytes=nbytes, ms=round(t * 1e3, 4), gbps=round(nbytes / t / 1e9, 1),
                        copy_ms=round(t_copy * 1e3, 4), copy_gbps=round(nbytes / t_copy / 1e9, 1),
                        of_copy=round(t_copy / t, 3), torch_path_ms=round(t_torch * 1e3, 4)))
        print(f"    {name:24s} {out[-1]['gbps']:8.1f} GB/s  copy {out[-1]['copy_gbps']:8.1f} GB/s  "
              f"({out[-1]['of_copy']:.2f} of copy)  torch path {out[-1]['torch_path_ms']:.3f} ms", flush=True)
    verdict = judge(out) if judged else dict(ok=True, judged=False)
    return dict(verdict, rows=out, note="GB/s counts bytes read + written; the copy moves the same bytes "
                                        "(half read, half written); the kernels' encode includes reading back the "
                                        "finite flag (one sync)")
