"""Packed layouts: exact round trips for every size, and carry-free lane sums (property tests)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lioncub.wire.kernels import pack_bytes, unpack_bytes
from lioncub.wire.packing import LANE_BITS, lane_bits_for, max_lane_value

sizes = st.integers(min_value=0, max_value=300)


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=st.integers(0, 2**31 - 1))
def test_sign_round_trip(n, seed):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(seed)) > 0.5
    packed = pack_bytes(bits.to(torch.uint8), n, 1)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
    assert torch.equal(unpack_bytes(packed, n, 1).bool(), bits)


@settings(max_examples=60, deadline=None)
@given(n=sizes, w=st.sampled_from(LANE_BITS), seed=st.integers(0, 2**31 - 1))
def test_lane_round_trip(n, w, seed):
    v = torch.randint(0, 2**w, (n,), generator=torch.Generator().manual_seed(seed))
    packed = pack_bytes(v.to(torch.uint8), n, w)
    assert packed.numel() == -(-n * w // 8)
    assert torch.equal(unpack_bytes(packed, n, w).long(), v)


@settings(max_examples=80, deadline=None)
@given(n=sizes, w=st.sampled_from(LANE_BITS), data=st.data())
def test_lane_sums_are_exact_when_they_fit(n, w, data):
    """Adding packed bytes of P workers adds every lane independently (no carries)."""
    cap = (1 << w) - 1
    world = data.draw(st.integers(1, cap))
    per_worker_max = cap // world  # every lane sum stays <= cap
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    vals = [torch.randint(0, per_worker_max + 1, (n,), generator=g) for _ in range(world)]
    total = torch.zeros(-(-n * w // 8), dtype=torch.int64)
    for v in vals:
        total += pack_bytes(v.to(torch.uint8), n, w).long()
    assert n == 0 or int(total.max()) <= 255  # so a uint8 SUM all-reduce is exact
    assert torch.equal(unpack_bytes(total.to(torch.uint8), n, w).long(), sum(vals))


def test_lane_width_rule():
    # binary signs: P <= 2**w - 1 ; values in [-s, s]: 2*s*P <= 2**w - 1
    assert [lane_bits_for(p) for p in (1, 3, 4, 15, 16, 255)] == [2, 2, 4, 4, 8, 8]
    assert [lane_bits_for(p, 1) for p in (1, 2, 7, 8, 127)] == [2, 4, 4, 8, 8]
    assert lane_bits_for(4, 31) == 8 and max_lane_value(4, 31) == 248
    with pytest.raises(ValueError, match="no lane width"):
        lane_bits_for(256)
    with pytest.raises(ValueError, match="no lane width"):
        lane_bits_for(4, 32)
