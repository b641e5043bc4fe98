"""Bit mismatches say what kind of difference they are, beside the located first element.

Bits stay the contract (every kind below fails), but a loader that stages BF16 through FP32
(exact for every finite value; NaN payloads canonicalized) must not read like a placement bug
across every property: the message says "only NaN payload bits differ", "sign of zero
differs" or "subnormals flushed to zero", else how many values differ.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync import compare


def bf16(*bits):
    return torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in bits],
                        dtype=torch.int16).view(torch.bfloat16)


def mismatch(actual, expected, **kwargs) -> compare.BitMismatchError:
    with pytest.raises(compare.BitMismatchError) as info:
        compare.assert_bitwise_equal(actual, expected, **kwargs)
    return info.value


NAN_PAYLOADS = bf16(0x7F81, 0xFFA1, 0x7FC0, 0x3F80, 0x7FFF)


def test_nan_payloads_canonicalized_are_named():
    staged = NAN_PAYLOADS.float().to(torch.bfloat16)  # what a BF16 -> FP32 -> BF16 loader does
    error = mismatch(staged, NAN_PAYLOADS, name="w")
    # torch's CPU conversion writes one canonical NaN (0xffff): every payload is lost
    canonical = int(staged.view(torch.int16)[0]) & 0xFFFF
    changed = sum(int(b) & 0xFFFF != canonical for b in NAN_PAYLOADS[[0, 1, 2, 4]].view(torch.int16))
    assert error.kinds == compare.DifferenceKinds(nan_payload=changed) and changed >= 3
    assert error.kinds.kind == "nan_payload"
    assert (f"{changed} of 5 elements differ bitwise: only NaN payload bits differ ({changed} "
            f"elements)") in str(error)
    assert f"first at w[0]: got nan (bits 0x{canonical:04x}), expected nan (bits 0x7f81)" in str(error)


def test_sign_of_zero_is_named():
    error = mismatch(bf16(0x8000, 0x0000, 0x3F80), bf16(0x0000, 0x0000, 0x3F80), name="w")
    assert "sign of zero differs (1 element); first at w[0]: got -0.0" in str(error), error
    assert error.kinds.kind == "zero_sign"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_subnormals_flushed_to_zero_are_named(dtype):
    info = torch.finfo(dtype)
    expected = torch.tensor([info.tiny / 4, -info.tiny / 2, 1.0, info.tiny], dtype=dtype)
    flushed = torch.where(expected.abs() < info.tiny, torch.zeros_like(expected) * expected.sign(),
                          expected)
    error = mismatch(flushed, expected, name="w")
    assert error.kinds == compare.DifferenceKinds(subnormal_flush=2), error.kinds
    assert "subnormals flushed to zero (2 elements); first at w[0]" in str(error)


def test_float8_kinds_follow_its_own_layout():
    e4m3 = torch.tensor([0x01, 0x80, 0x7F, 0x38], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = e4m3.view(torch.uint8).clone()
    got[0], got[1] = 0x00, 0x00  # subnormal flushed, -0 -> +0
    assert mismatch(got.view(torch.float8_e4m3fn), e4m3).kinds == compare.DifferenceKinds(
        zero_sign=1, subnormal_flush=1)
    # in the fnuz types 0x80 is the NaN, not a negative zero
    fnuz = torch.tensor([0x80], dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    zero = torch.tensor([0x00], dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    assert mismatch(fnuz, zero).kinds == compare.DifferenceKinds(value=1)


def test_mixed_and_value_differences_give_the_counts():
    expected = bf16(0x7F81, 0x0000, 0x3F80, 0x4000)
    actual = bf16(0x7FC0, 0x8000, 0x4000, 0x3F80)
    error = mismatch(actual, expected, name="w")
    assert error.kinds == compare.DifferenceKinds(nan_payload=1, zero_sign=1, value=2)
    assert ("4 of 4 elements differ bitwise: values differ (2 elements), besides NaN payload "
            "bits (1 element), sign of zero (1 element); first at w[0]") in str(error)
    ints = torch.arange(6).reshape(2, 3)
    changed = ints.clone()
    changed[1, 2] = 7
    error = mismatch(changed, ints, name="i")
    assert "1 of 6 elements differ bitwise: values differ (1 element); first at i[1, 2]" in str(error)
    assert error.index == (1, 2) and error.kinds.kind == "value"


def test_the_kind_stands_beside_the_located_first_element():
    expected = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[1, 2, 3] = -0.0
    error = mismatch(actual, expected, name="w13", rank=2,
                     locate=lambda name, index: f"layer=0 expert={index[0]} row={index[1]}")
    assert ("w13 on receiver rank 2: 1 of 24 elements differ bitwise: sign of zero differs "
            "(1 element); first at layer=0 expert=1 row=2 (w13[1, 2, 3])") in str(error), error


def test_tens_of_mib_are_classified_exactly():
    """A 16 MiB BF16 tensor with every kind planted at known places: the counts are exact and
    the first element is found (vectorized: no Python loop over elements)."""
    n = 8 << 20
    expected = (torch.arange(n, dtype=torch.int32) % 0x3F00 + 0x80).to(torch.int16)
    # disjoint places (index mod 4 tells the kind): NaNs, zeros, subnormals, one wrong value
    expected[8::1000] = 0x7F81          # NaN with a payload
    expected[1::4096] = 0x0000          # +0
    expected[2::8192] = 0x0003          # a subnormal
    actual = expected.clone()
    actual[8::1000] = 0x7FC1
    actual[1::4096] = -32768            # -0 (0x8000)
    actual[2::8192] = 0x0000
    actual[n - 1] ^= 1                  # one wrong value, at the very end
    error = mismatch(actual.view(torch.bfloat16), expected.view(torch.bfloat16), name="big")
    nans, zeros, subs = len(range(8, n, 1000)), len(range(1, n, 4096)), len(range(2, n, 8192))
    assert error.kinds == compare.DifferenceKinds(nan_payload=nans, zero_sign=zeros,
                                                  subnormal_flush=subs, value=1)
    assert error.count == nans + zeros + subs + 1 and error.index == (1,)


def test_a_loader_staging_bf16_through_fp32_gets_the_nan_message():
    """The held-out mutant: exact for every finite value, so only NaN payloads differ; the
    report must say so rather than look like a placement bug."""
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation
    from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology
    from pytest_weightsync.reference_impl.senders.formats import export

    class StagesThroughFp32(ReferenceImplementation):
        def load_weights(self, params, payload, **kwargs):
            super().load_weights(params, [(n, t.float().to(t.dtype)) for n, t in payload],
                                 **kwargs)

    spec, topology = MoESpec(num_layers=1, num_experts=2, hidden=8, intermediate=8), ReceiverTopology()
    expected = synth.expected_receiver_params(spec, topology, 0, 1)
    params = {name: synth.poison_(torch.empty_like(t)) for name, t in expected.items()}
    kwargs = dict(format="compat", spec=spec, topology=topology, rank=0)
    StagesThroughFp32().load_weights(params, export("compat", spec, topology, 0,
                                                    synth.full_weights(spec, 1)), **kwargs)
    with pytest.raises(compare.BitMismatchError, match=r"only NaN payload bits differ \(\d+ "
                                                       r"elements\)") as info:
        compare.assert_state_equal(params, expected)
    assert info.value.kinds.kind == "nan_payload"
