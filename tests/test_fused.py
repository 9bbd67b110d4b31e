"""The compiled fused loops equal the torch ops they replace, bit for bit."""
import pytest
import torch

from lioncub import fused
from lioncub.wire import kernels
from lioncub.lion import apply_update_, interpolate
from tests.kernel_data import kernel_tensors

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler: the fused loops are not built")

SIZES = [[0], [1], [7, 9], [8, 16, 3], [1001, 5, 0, 64], [4099]]


_tensors = kernel_tensors


@pytest.mark.parametrize("sizes", SIZES)
def test_encode_equals_interpolate_then_pack(sizes):
    ms, gs = _tensors(sizes, seed=len(sizes))
    n = sum(sizes)
    for beta1, maximize in [(0.9, False), (0.95, True), (0.0, False), (1 - 1e-4, False), (0.3, True)]:
        c = torch.cat([x.reshape(-1) for x in interpolate(ms, gs, beta1, maximize=maximize)] + [torch.zeros(0)])
        for step in (0, 1):
            for bits in (1, 2, 4, 8):
                want = kernels.pack_bytes(kernels.sign_bits(c, step), n, bits) if n else torch.zeros(0, dtype=torch.uint8)
                got = torch.full((-(-n * bits // 8),), 0xAA, dtype=torch.uint8)
                fused.encode(ms, gs, beta1, maximize, got, bits=bits, step=step)
                assert torch.equal(got, want), (beta1, maximize, step, bits)
        got = torch.full((n,), 7, dtype=torch.uint8)
        fused.encode(ms, gs, beta1, maximize, got, bits=8, step=0, signs=True)
        assert torch.equal(got.view(torch.int8), torch.sign(c).to(torch.int8))
        values = torch.full((n,), float("nan"))
        assert fused.interpolate(ms, gs, beta1, maximize, values) is True
        assert torch.equal(values.view(torch.int32), c.view(torch.int32))  # bit for bit, -0.0 too



def test_encode_reports_nonfinite_gradients_at_every_position():
    """encode's return is guard.grads_finite of the same gradients: False for one NaN/±Inf
    anywhere (AVX2 blocks, scalar blocks, the partial bytes between tensors, int8 signs),
    True for finite values however large; the packed bytes are unchanged by the check."""
    sizes = [3, 21, 5]  # byte edges inside tensors: scalar heads/tails and 8-wide blocks
    ms, gs = _tensors(sizes, seed=3)
    gs[1][4] = torch.finfo(torch.float32).max  # huge but finite: not flagged
    gs[2][0] = -torch.finfo(torch.float32).max
    n = sum(sizes)
    values = torch.empty(n)
    assert fused.interpolate(ms, gs, 0.9, False, values) is True
    for t, size in enumerate(sizes):
        for i in range(size):
            g2 = [x.clone() for x in gs]
            g2[t][i] = float("nan") if i % 2 else float("-inf")
            assert fused.interpolate(ms, g2, 0.9, False, values) is False, (t, i)
    for bits, signs in ((1, False), (2, False), (4, False), (8, False), (8, True)):
        out = torch.empty(n if signs else -(-n * bits // 8), dtype=torch.uint8)
        assert fused.encode(ms, gs, 0.9, False, out, bits=bits, step=0, signs=signs) is True
        for t, size in enumerate(sizes):
            for i in range(size):
                for bad in (float("nan"), float("inf"), float("-inf")):
                    g2 = [x.clone() for x in gs]
                    g2[t][i] = bad
                    assert fused.encode(ms, g2, 0.9, False, out, bits=bits, step=1, signs=signs) is False, \
                        (bits, signs, t, i, bad)


@pytest.mark.parametrize("n", [0, 1, 3, 8, 13, 1001, 4099])
def test_quantize_lanes_equals_round_clamp_then_pack(n):
    """Lanes of q + s, q = round(c·mult) (half to even) clamped to ±s, as quantize._scaled
    + kernels.pack_bytes: exact halves, values past ±s, ±0.0, and mult = 0."""
    g = torch.Generator().manual_seed(n)
    c = torch.randn(n, generator=g) * 3
    c[::4] = (torch.arange(len(c[::4]), dtype=torch.float32) - 6) + 0.5  # k + 0.5: ties, both signs
    if n > 2:
        c[1], c[2] = -0.0, 0.0
    for bits, levels in ((2, 1), (4, 3), (4, 7), (8, 31), (8, 127)):
        for mult in (1.0, 0.7316, 127 / 2.3, 0.0):
            want = torch.round(c * mult).clamp_(-levels, levels).to(torch.int8).view(torch.uint8) + levels
            want = kernels.pack_bytes(want, n, bits) if n else torch.zeros(0, dtype=torch.uint8)
            got = torch.full((-(-n * bits // 8),), 0xAA, dtype=torch.uint8)
            fused.quantize_lanes(c, mult, levels, bits, got)
            assert torch.equal(got, want), (bits, levels, mult)
    with pytest.raises(ValueError, match="levels must be in \\[1, 7\\] for 4-bit lanes"):
        fused.quantize_lanes(c, 1.0, 8, 4, torch.zeros(-(-n * 4 // 8), dtype=torch.uint8))

@pytest.mark.parametrize("sizes", SIZES)
def test_apply_equals_apply_update(sizes):
    for lr, wd, beta2, maximize in [(1e-3, 0.0, 0.99, False), (3e-4, 0.1, 0.98, True), (0.7, 1.3, 0.5, False)]:
        ms, gs = _tensors(sizes, seed=7)
        g = torch.Generator().manual_seed(11)
        ps = [torch.randn(n, generator=g) for n in sizes]
        u = torch.randint(-1, 2, (sum(sizes),), generator=g, dtype=torch.int8)
        ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
        us = list(u.float().split(sizes))
        apply_update_(ps_ref, us, ms_ref, gs, lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize, foreach=True)
        fused.apply(ps, ms, gs, u, lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize)
        for a, b in zip(ps + ms, ps_ref + ms_ref):
            assert torch.equal(a, b), (lr, wd, beta2, maximize)


@pytest.mark.parametrize("sizes", SIZES + [[3, 5, 17, 8, 1]])
def test_apply_bits_equals_apply_of_unpacked_votes(sizes):
    """u from packed bits (1-bit vote: ±1; gather: pos − neg) at odd tensor boundaries."""
    n = sum(sizes)
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(0, 2, (2, n), generator=g, dtype=torch.uint8)
    pos_b, neg_b = bits[0], bits[1] * (1 - bits[0])  # never both set
    pack = (lambda b: kernels.pack_bytes(b.clone(), n, 1)) if n else (lambda b: torch.zeros(0, dtype=torch.uint8))
    for neg, u in [(None, 2 * pos_b.to(torch.int8) - 1), (pack(neg_b), pos_b.to(torch.int8) - neg_b.to(torch.int8))]:
        for lr, wd, beta2, maximize in [(1e-3, 0.0, 0.99, False), (3e-4, 0.1, 0.98, True)]:
            ms, gs = _tensors(sizes, seed=3)
            ps = [torch.randn(k, generator=g) for k in sizes]
            ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
            fused.apply(ps_ref, ms_ref, gs, u, lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize)
            fused.apply_bits(ps, ms, gs, pack(pos_b), neg, lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize)
            assert all(torch.equal(a, b) for a, b in zip(ps + ms, ps_ref + ms_ref)), (neg is None, lr)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sizes", SIZES + [[3, 5, 17, 8, 1]])
def test_apply_lanes_equals_apply_of_vote_lanes(sizes, bits):
    """u from w-bit lane sums (the pbit vote) at odd tensor boundaries, every threshold pair."""
    n, top = sum(sizes), (1 << bits) - 1
    g = torch.Generator().manual_seed(n + bits)
    k = torch.randint(0, top + 1, (n,), generator=g, dtype=torch.uint8)
    lanes = kernels.pack_bytes(k.clone(), n, bits) if n else torch.zeros(0, dtype=torch.uint8)
    for above, below in [(2, 2), (1, 2), (top // 2, (top + 1) // 2), (0, 0), (top, top)]:
        u = kernels.vote_lanes(lanes, n, bits, above, below) if n else torch.zeros(0, dtype=torch.int8)
        ms, gs = _tensors(sizes, seed=4)
        ps = [torch.randn(j, generator=g) for j in sizes]
        ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
        fused.apply(ps_ref, ms_ref, gs, u, lr=1e-3, beta2=0.99, weight_decay=0.1)
        fused.apply_lanes(ps, ms, gs, lanes, bits, above, below, lr=1e-3, beta2=0.99, weight_decay=0.1)
        assert all(torch.equal(a, b) for a, b in zip(ps + ms, ps_ref + ms_ref)), (above, below)


def test_per_tensor_hyperparameters_equal_one_call_per_tensor():
    """Param groups: one call with per-tensor β1/lr/... equals the torch ops per tensor."""
    sizes = [13, 8, 21]
    ms, gs = _tensors(sizes, seed=5)
    betas, maxi = [0.9, 0.5, 0.99], [False, True, False]
    c = torch.cat([interpolate([m], [g], b, maximize=x)[0] for m, g, b, x in zip(ms, gs, betas, maxi)])
    got = torch.empty(-(-sum(sizes) // 8), dtype=torch.uint8)
    fused.encode(ms, gs, betas, maxi, got, bits=1, step=1)
    assert torch.equal(got, kernels.pack_bytes(kernels.sign_bits(c, 1), sum(sizes), 1))
    g = torch.Generator().manual_seed(2)
    ps = [torch.randn(n, generator=g) for n in sizes]
    u = torch.randint(-1, 2, (sum(sizes),), generator=g, dtype=torch.int8)
    ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
    hp = [(1e-2, 0.0, 0.9, False), (3e-3, 0.2, 0.95, True), (0.5, 1.0, 0.99, False)]
    for p, m, gr, uu, (lr, wd, b2, x) in zip(ps_ref, ms_ref, gs, u.float().split(sizes), hp):
        apply_update_([p], [uu], [m], [gr], lr=lr, beta2=b2, weight_decay=wd, maximize=x)
    fused.apply(ps, ms, gs, u, lr=[h[0] for h in hp], weight_decay=[h[1] for h in hp],
                beta2=[h[2] for h in hp], maximize=[h[3] for h in hp])
    assert all(torch.equal(a, b) for a, b in zip(ps + ms, ps_ref + ms_ref))


def test_usable_only_for_contiguous_fp32_cpu():
    x = torch.zeros(4, 4)
    assert fused.usable([x], [x[0]])
    assert not fused.usable([x.t()]) and not fused.usable([x.double()]) and not fused.usable([x.bfloat16()])


def test_the_backend_is_chosen_once_per_bucket_by_the_fused_argument():
    from tests.flat import LionCub

    fp32, fp64 = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3).double()
    params = list(fp32.parameters()) + list(fp64.parameters())
    opt = LionCub(params, bucket_mb=15 * 4 / 2**20)  # a bucket per module; fused=None: where the loops run
    assert [r.split(":")[0] for r in opt.backends] == ["torch", "fused"], opt.backends
    assert "float64" in opt.backends[0] and [b.fused for b in opt.buckets] == [False, True]
    assert all(r == "torch: fused=False" for r in LionCub(params, fused=False).backends)
    assert all(b.fused for b in LionCub(fp32.parameters(), fused=True).buckets)
    with pytest.raises(ValueError, match="fused=True but the fused loops cannot run: a torch.float64 tensor"):
        LionCub(fp64.parameters(), fused=True)
    with pytest.raises(TypeError, match="fused must be None, True or False, got 'yes'"):
        LionCub(fp32.parameters(), fused="yes")


def test_a_loaded_momentum_in_another_layout_is_read_by_its_values():
    """The backend is chosen from the parameters; a checkpoint's non-contiguous momentum
    (here a transposed view) must still reach the fused loops as its values."""
    from tests.flat import LionCub

    runs = []
    for use in (True, False):
        p = torch.nn.Parameter(torch.arange(16.0).view(4, 4))
        opt = LionCub([p], lr=0.1, fused=use)
        p.grad = torch.ones(4, 4)
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["exp_avg"] = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).t()
        opt.load_state_dict(sd)
        p.grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        opt.step()
        runs.append(torch.cat([p.detach().reshape(-1), opt.state[p]["exp_avg"].reshape(-1)]))
    assert torch.equal(runs[0], runs[1])


def test_wrong_buffers_are_named():
    ms, gs = _tensors([10], 0)
    with pytest.raises(ValueError, match="out must be a contiguous uint8 tensor of 2 bytes"):
        fused.encode(ms, gs, 0.9, False, torch.zeros(3, dtype=torch.uint8), bits=1, step=0)
    with pytest.raises(ValueError, match="u must be a contiguous int8 tensor of 10 elements"):
        fused.apply(ms, ms, gs, torch.zeros(10), lr=0.1, beta2=0.9, weight_decay=0.0)
