"""The update side's Triton kernels equal the torch CPU path bit for bit: ``p ← p·decay − lr·u`` and
``m ← β2·m + (1-β2)·g`` from int8 votes, packed bits or lane sums, and a whole Lion step with its device skip flag,
every tensor of a call in one launch. Interpreted on CPU, compiled on CUDA under ``make gpu-check``
(tests/triton_cases.py says how)."""
import contextlib
from unittest import mock

from tests import triton_cases  # before torch, triton and lioncub: it sets up the interpreter
from tests.triton_cases import DEVICE, HYPER, SIZES, _apply_case, _d, _launches, _reference, _same, cases, tk

import torch  # noqa: E402

from lioncub import fused  # noqa: E402
from lioncub.wire import kernels  # noqa: E402

_interpreter = triton_cases.interpreter  # pytest's autouse fixture: the interpreter around each test here


@cases("sizes", SIZES)
def test_apply_and_apply_bits_equal_apply_update(sizes):
    """From int8 u, from packed ±1 bits (1-bit vote) and from pos − neg bits (gather)."""
    n = sum(sizes)
    g = torch.Generator().manual_seed(n)
    u = torch.randint(-1, 2, (n,), generator=g, dtype=torch.int8)
    bits = torch.randint(0, 2, (2, n), generator=g, dtype=torch.uint8)
    pos_b, neg_b = bits[0], bits[1] * (1 - bits[0])
    pack = lambda b: kernels.pack_bytes(b.clone(), n, 1)  # noqa: E731
    for lr, wd, beta2, maximize in HYPER:
        for how, votes in [("u", u), ("pm1", 2 * pos_b.to(torch.int8) - 1),
                           ("posneg", pos_b.to(torch.int8) - neg_b.to(torch.int8))]:
            ps, ms, gs = _apply_case(sizes, seed=5)
            want = _reference(ps, ms, gs, votes, lr, wd, beta2, maximize)
            hp = dict(lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize)
            ps, ms, gs = _d(ps), _d(ms), _d(gs)
            if how == "u":
                tk.apply(ps, ms, gs, _d(votes), **hp)
            else:
                tk.apply_bits(ps, ms, gs, _d(pack(pos_b)), None if how == "pm1" else _d(pack(neg_b)), **hp)
            assert _same(ps + ms, want), (how, lr)


@cases("bits", [2, 4, 8])
def test_apply_lanes_equals_vote_lanes_then_apply_update(bits):
    sizes = [3, 5, 17, 0, 1030]
    n, top = sum(sizes), (1 << bits) - 1
    g = torch.Generator().manual_seed(bits)
    k = torch.randint(0, top + 1, (n,), generator=g, dtype=torch.uint8)
    lanes = kernels.pack_bytes(k.clone(), n, bits)
    for above, below in [(1, 2), (top // 2, (top + 1) // 2), (0, 0), (top, top)]:
        u = kernels.vote_lanes(lanes, n, bits, above, below)
        ps, ms, gs = _apply_case(sizes, seed=6)
        want = _reference(ps, ms, gs, u, 1e-3, 0.1, 0.99, False)
        ps, ms, gs = _d(ps), _d(ms), _d(gs)
        tk.apply_lanes(ps, ms, gs, _d(lanes), bits, above, below, lr=1e-3, beta2=0.99, weight_decay=0.1)
        assert _same(ps + ms, want), (above, below)


def test_per_tensor_hyperparameters():
    sizes = [13, 8, 21]
    ps, ms, gs = _apply_case(sizes, seed=9)
    u = torch.randint(-1, 2, (sum(sizes),), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    hp = [(1e-2, 0.0, 0.9, False), (3e-3, 0.2, 0.95, True), (0.5, 1.0, 0.99, False)]
    want = []
    for p, m, gr, uu, (lr, wd, b2, x) in zip(ps, ms, gs, u.split(sizes), hp):
        want.append(_reference([p], [m], [gr], uu, lr, wd, b2, x))
    ps, ms, gs = _d(ps), _d(ms), _d(gs)
    tk.apply(ps, ms, gs, _d(u), lr=[h[0] for h in hp], weight_decay=[h[1] for h in hp],
             beta2=[h[2] for h in hp], maximize=[h[3] for h in hp])
    assert _same(ps + ms, [w[0] for w in want] + [w[1] for w in want])



def test_apply_is_one_launch_for_every_tensor_of_a_call():
    """The apply for 300 tensors (a 1.3B GPT has about as many) is one launch (before: 300), its result still the
    torch path's bit for bit."""
    sizes = [3, 1, 2] * 100
    n = sum(sizes)
    ps, ms, gs = _apply_case(sizes, seed=12)
    u = torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    want = _reference(ps, ms, gs, u, 1e-3, 0.1, 0.99, False)
    ps, ms, gs = _d(ps), _d(ms), _d(gs)
    with _launches() as launched:
        tk.apply(ps, ms, gs, _d(u), lr=1e-3, beta2=0.99, weight_decay=0.1)
    assert launched == [tk._apply_kernel] and _same(ps + ms, want)


@cases("sizes", SIZES)
def test_lion_step_equals_lion_and_a_set_skip_flag_changes_nothing(sizes):
    """A whole Lion step in one launch (u = sign(c) made in the kernel; c = 0 exactly where m and g tie) equals
    lioncub.lion.lion bit for bit; with the device flag set (a non-finite gradient, decided on the device) p and
    m stay as they were, bit for bit, even where g holds NaN and Inf."""
    from lioncub.lion import lion

    for lr, wd, beta2, maximize in HYPER:
        for beta1 in (0.9, 0.5):
            ps, ms, gs = _apply_case(sizes, seed=31)
            want_p, want_m = [p.clone() for p in ps], [m.clone() for m in ms]
            lion(want_p, gs, want_m, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, maximize=maximize, foreach=True)
            hp = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, maximize=maximize)
            got_p, got_m, got_g = _d(ps), _d(ms), _d(gs)
            tk.lion_step(got_p, got_m, got_g, **hp, skip=_d(torch.tensor(False)))
            assert _same(got_p + got_m, want_p + want_m), (lr, beta1)
            got_p, got_m, got_g = _d(ps), _d(ms), _d(gs)
            if sum(sizes) > 1:
                got_g[-1].view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
            tk.lion_step(got_p, got_m, got_g, **hp, skip=_d(torch.tensor(True)))
            assert _same(got_p + got_m, ps + ms), (lr, beta1)


def test_localcub_decides_a_non_finite_inner_step_on_the_device():
    """LocalCub's inner Lion through the one-launch kernel with the skip flag on the device (CUDA's path, here with
    the kernels interpreted on CPU tensors): the same parameters, momenta and skipped round as the host-read path,
    with no host read in any inner step (the round's end reads once)."""
    from tests.flat import LocalCub

    def run(device_path: bool):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5)]
        if device_path:  # on the GPU (make gpu-check) its own tensors; here CPU tensors the kernels interpret
            ps = [torch.nn.Parameter(p.detach().to(DEVICE)) for p in ps]
        opt = LocalCub(ps, lr=1e-2, local_steps=3, nonfinite="skip")
        reads = []
        for step in range(9):  # rounds 0-2; a NaN in step 4 (round 1): that round is dropped
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.device)
            if step == 4:
                ps[0].grad[3] = float("nan")
            with contextlib.ExitStack() as patches:
                if device_path and DEVICE == "cpu":
                    patches.enter_context(mock.patch.object(fused, "_gpu", lambda t: tk))
                    patches.enter_context(mock.patch.object(fused, "usable", lambda *lists: True))
                real_bool, real_item = torch.Tensor.__bool__, torch.Tensor.item
                patches.enter_context(mock.patch.object(torch.Tensor, "__bool__",
                                                        lambda t: (reads.append(step), real_bool(t))[1]))
                patches.enter_context(mock.patch.object(torch.Tensor, "item",
                                                        lambda t: (reads.append(step), real_item(t))[1]))
                opt.step()
        return ps, opt, reads

    host_ps, host, host_reads = run(False)
    dev_ps, dev, dev_reads = run(True)
    assert host.skipped_rounds == dev.skipped_rounds == 1 and host.rounds == dev.rounds == 2
    assert _same(dev_ps + [dev.inner.state[p]["exp_avg"] for p in dev_ps],
                 host_ps + [host.inner.state[p]["exp_avg"] for p in host_ps])
    inner_steps = [s for s in range(9) if (s + 1) % 3]
    assert all(s in host_reads for s in inner_steps)  # the host path reads every inner step's verdict
    assert not any(s in dev_reads for s in inner_steps)  # the device path reads none of them
