"""The fast kernels against plain reference loops (docs/design.md §12), element for element.

The references below are written independently of :mod:`lioncub.wire.kernels`: one bit or
lane at a time, with integer arithmetic in int64. The vote methods run on the kernels,
so they are checked here against the same references.
"""
import pytest
import torch

from lioncub.wire import kernels
from lioncub.votes import binary_signs, decide

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 100, 1001, 4099, 65539]


def ref_pack(values, bits):
    """Element 8j/bits + k goes to bits [k*bits, (k+1)*bits) of byte j."""
    per = 8 // bits
    v = values.reshape(-1).long()
    out = torch.zeros(-(-v.numel() // per), dtype=torch.long)
    for k in range(per):
        part = v[k::per]
        out[: part.numel()] += part << (k * bits)
    return out.to(torch.uint8)


def ref_unpack(packed, n, bits):
    per = 8 // bits
    p = packed.long()
    lanes = torch.stack([(p >> (k * bits)) & ((1 << bits) - 1) for k in range(per)], dim=1)
    return lanes.reshape(-1)[:n]


def ref_decide(count, world, step, ties):
    d = 2 * count.long() - world
    u = torch.sign(d)
    if ties == "parity":
        u[d == 0] = 1 if step % 2 == 0 else -1
    return u.to(torch.int8)


@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_match_reference(n):
    g = torch.Generator().manual_seed(n)
    for bits in (1, 2, 4, 8):
        v = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
        ref = ref_pack(v, bits)
        assert torch.equal(kernels.pack_bytes(v, n, bits), ref), bits
        assert torch.equal(kernels.unpack_bytes(ref, n, bits).long(), ref_unpack(ref, n, bits)), bits
        if bits == 1:
            assert torch.equal(kernels.unpack_pm1(ref, n).long(), ref_unpack(ref, n, 1) * 2 - 1)


@pytest.mark.parametrize("n", SIZES)
def test_sign_bits_fuse_quantize_and_pack(n):
    c = torch.randn(n, generator=torch.Generator().manual_seed(1))
    c[::3] = 0.0
    if n > 2:
        c[1] = -0.0  # -0.0 is a zero: parity decides, like +0.0
    for step in (0, 1, 2, 7):
        buf = kernels.sign_bits(c, step)
        assert buf.numel() % 8 == 0 and not buf[n:].any()
        assert torch.equal(buf[:n].bool(), binary_signs(c, step))
        assert torch.equal(kernels.pack_bytes(buf, n, 1), ref_pack(binary_signs(c, step), 1))
        padded = kernels.sign_bits(c, step, length=n + 37)
        assert padded.numel() >= n + 37 and not padded[n:].any()


@pytest.mark.parametrize("world", list(range(1, 17)) + [255])
def test_decide_matches_reference_for_every_count(world):
    """votes.decide (the reference path's decode) over every k = 0..P, as uint8 counts
    (2k overflows uint8 past P = 127) and int64 counts, both tie rules."""
    for dtype in (torch.uint8, torch.int64):
        count = torch.arange(world + 1, dtype=dtype)
        for step in (0, 1):
            for ties in ("zero", "parity"):
                u = decide(count, world, step, ties=ties)
                assert u.dtype == torch.int8
                assert torch.equal(u, ref_decide(count, world, step, ties)), (world, dtype, step, ties)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16, 31, 255])
def test_word_votes_on_packed_bits_match_reference(world):
    """vote_bits / majority_bits / spread_votes / unpack_pm1 against integer counts."""
    g = torch.Generator().manual_seed(world)
    for n in (1, 9, 64, 1003):
        bits = torch.rand(world, n, generator=g) < 0.5
        if world % 2 == 0 and n > 4:  # exact ties on a few coordinates
            bits[:, :4] = torch.arange(world).unsqueeze(1) < world // 2
        packed = torch.stack([ref_pack(b, 1) for b in bits])
        count = bits.long().sum(0)
        gt, eq = kernels.vote_bits(packed, world)
        gt_b = ref_unpack(gt.view(torch.uint8)[: packed.shape[1]], n, 1)
        eq_b = ref_unpack(eq.view(torch.uint8)[: packed.shape[1]], n, 1)
        assert torch.equal(gt_b, (2 * count > world).long()) and torch.equal(eq_b, (2 * count == world).long())
        lt = ~(gt | eq)
        for dtype in (torch.int8, torch.float32, torch.bfloat16):
            u = kernels.spread_votes(gt, lt, n, dtype)
            assert u.dtype == dtype and torch.equal(u.long(), ref_decide(count, world, 0, "zero").long())
            buf = torch.full((n + 3,), 7, dtype=dtype)  # out: a view into a larger buffer
            assert kernels.spread_votes(gt, lt, n, dtype, out=buf[1:n + 1]).data_ptr() == buf[1:].data_ptr()
            assert torch.equal(buf[1:n + 1], u) and buf[0] == 7 and buf[n + 1] == 7
        for step in (0, 1, 2, 3):
            voted = kernels.majority_bits(packed, world, step)
            assert voted.dtype == torch.uint8 and voted.numel() == packed.shape[1]
            want = ref_decide(count, world, step, "parity").long()
            assert torch.equal(ref_unpack(voted, n, 1) * 2 - 1, want)
            for dtype in (torch.int8, torch.float32, torch.float64):
                u = kernels.unpack_pm1(voted, n, dtype)
                assert u.dtype == dtype and torch.equal(u.long(), want)
                buf = torch.full((n + 2,), 7, dtype=dtype)
                kernels.unpack_pm1(voted, n, dtype, out=buf[1:n + 1])
                assert torch.equal(buf[1:n + 1], u) and buf[0] == 7 and buf[n + 1] == 7


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_vote_lanes_matches_reference(bits):
    g = torch.Generator().manual_seed(bits)
    top = (1 << bits) - 1
    for n in (1, 3, 8, 17, 1001):
        k = torch.randint(0, top + 1, (n,), generator=g, dtype=torch.uint8)
        packed = ref_pack(k, bits)
        for above, below in [(0, 1), (1, 2), (2, 2), (top // 2, (top + 1) // 2), (top, top), (0, 0)]:
            want = (k.long() > above).long() - (k.long() < below).long()
            for dtype in (torch.int8, torch.float32):
                u = kernels.vote_lanes(packed, n, bits, above, below, dtype)
                assert u.dtype == dtype and torch.equal(u.long(), want), (n, above, below)
                buf = torch.full((n + 2,), 7, dtype=dtype)
                kernels.vote_lanes(packed, n, bits, above, below, dtype, out=buf[1:n + 1])
                assert torch.equal(buf[1:n + 1], u) and buf[0] == 7 and buf[n + 1] == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none in this environment)")
def test_cuda_kernels_match_cpu_reference():
    n, world = 100_003, 4
    dev = torch.device("cuda")
    c = torch.randn(n)
    c[::7] = 0
    for step in (0, 1):
        buf = kernels.sign_bits(c.to(dev), step)
        packed = kernels.pack_bytes(buf, n, 1)
        assert torch.equal(packed.cpu(), ref_pack(binary_signs(c, step), 1))
    bits = torch.rand(world, n) < 0.5
    packed = torch.stack([ref_pack(b, 1) for b in bits])
    gt, eq = kernels.vote_bits(packed.to(dev), world)
    u = kernels.spread_votes(gt, ~(gt | eq), n, torch.int8)
    assert torch.equal(u.cpu(), ref_decide(bits.long().sum(0), world, 0, "zero"))
    for w in (2, 4):
        v = torch.randint(0, 1 << w, (n,), dtype=torch.uint8)
        assert torch.equal(kernels.pack_bytes(v.to(dev), n, w).cpu(), ref_pack(v, w))
        assert torch.equal(kernels.unpack_bytes(ref_pack(v, w).to(dev), n, w).cpu().long(), v.long())


def test_the_fused_loops_ship_and_build_where_a_compiler_exists():
    """tests/test_fused.py skips without the loops; this makes sure a missing C file or a
    broken build cannot hide behind that skip on a machine that has a compiler."""
    import os
    import shutil

    from lioncub import fused

    assert os.path.isfile(fused._SOURCE_PATH), "lioncub/fused/fused.c is not installed with the package"
    if shutil.which(os.environ.get("CC", "cc")) and os.environ.get("LIONCUB_FUSED", "1") != "0":
        assert fused.available()


def test_fused_status_says_why_and_lioncub_warns_once_about_the_slow_path(monkeypatch, tmp_path):
    """No compiler / a failed build: status names the cause, and LionCub on fp32 CPU params
    warns (RuntimeWarning) that the torch path runs; LIONCUB_FUSED=0 chooses it silently."""
    import re
    import warnings

    from lioncub import fused
    from tests.flat import LionCub

    broken = tmp_path / "cc"
    broken.write_text('#!/bin/sh\necho "fused.c:1: error: broken on purpose" >&2\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("LIONCUB_CACHE", str(tmp_path / "cache"))
    try:
        for cc, want in (("no-such-cc", re.escape("unavailable: no C compiler ('no-such-cc' not on PATH)")),
                         (str(broken), re.escape(f"unavailable: {broken} failed to build ") + ".*broken on purpose")):
            monkeypatch.setenv("CC", cc)
            fused._build.cache_clear()
            assert not fused.available()
            assert re.fullmatch(want, fused.status()), fused.status()
            with pytest.warns(RuntimeWarning, match="fused CPU loops are unavailable.*torch path runs instead"):
                LionCub(torch.nn.Linear(3, 2).parameters())
        monkeypatch.setenv("LIONCUB_FUSED", "0")
        fused._build.cache_clear()
        assert fused.status() == "off: LIONCUB_FUSED=0"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LionCub(torch.nn.Linear(3, 2).parameters())
    finally:
        monkeypatch.undo()
        fused._build.cache_clear()  # the real build again (from its cache) for later tests
