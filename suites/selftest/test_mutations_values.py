"""A lossy conversion anywhere on the load path fails bit_exact, and says where.

The synthetic weights span every BF16 pattern a lossy conversion changes (exponents beyond
FP16's range on both ends, subnormals, signed zeros, infinities, NaN payloads, all 7 mantissa
bits), so a loader that rounds the payload through FP16, FP8 or FP32 arithmetic before
copying it cannot pass the conformance check. Each mutant here is the reference loader with
such a conversion planted in front of it, run through the same ``conformance_harness``
load-and-check the loader suites use.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.vocabulary import FORMATS

from ..harness import inputs, judge, loader
from ..harness.cases import Case
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology

pytestmark = pytest.mark.weightsync_property("mutation_detected")

CASE = Case(MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=8),
            TrainerTopology(tp=2, ep=2, etp=2),
            ReceiverTopology(tp=2, moe_ep=2, order="up_gate"))


def _through(dtype):
    return lambda t: t.to(dtype).to(t.dtype)


#: A conversion a buggy loader applies to every payload tensor before copying it.
LOSSY = {
    "fp16_round_trip": _through(torch.float16),
    "fp8_e4m3_round_trip": _through(torch.float8_e4m3fn),
    "fp8_e5m2_round_trip": _through(torch.float8_e5m2),
    # fp32 arithmetic: x * 1 + 0 turns -0 into +0 and quiets/canonicalizes NaN payloads
    "fp32_arithmetic": lambda t: (t.float() * 1.0 + 0.0).to(t.dtype),
    # a scale applied and undone in fp32: the top binade overflows to inf
    "fp32_scale_unscale": lambda t: (t.float() * 4.0 / 4.0).to(t.dtype),
    # NaN-scrubbing "sanitizer" a loader might add
    "nan_to_num": lambda t: torch.nan_to_num(t),
}


class LossyLoader(ReferenceImplementation):
    """The reference loader with one lossy conversion of the payload in front of it."""

    def __init__(self, convert):
        super().__init__()
        self.convert = convert

    def load_weights(self, params, payload, **kwargs):
        super().load_weights(params, [(n, self.convert(t)) for n, t in payload], **kwargs)


@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("conversion", sorted(LOSSY))
def test_lossy_loader_fails_bit_exact_with_a_location(conversion, payload_format):
    mutant = LossyLoader(LOSSY[conversion])
    params = inputs.receiver_params(CASE, 0)
    before = compare.snapshot(params)
    loader.load(mutant, params, payload_format, CASE, 0, version=1)
    with pytest.raises(AssertionError) as info:
        judge.check_rank(params, CASE, 0, 1, before)
    message = str(info.value)
    for word in ("layer=", "expert=", "projection=", "row=", "col=", "receiver_rank=0"):
        assert word in message, message


@pytest.mark.parametrize("payload_format", FORMATS)
def test_staging_through_fp32_is_named_as_a_value_conversion_not_a_placement_bug(payload_format):
    """BF16 -> FP32 -> BF16 is exact for every finite value; only NaN payloads change. The
    failure says so instead of reading like a placement bug."""
    mutant = LossyLoader(lambda t: t.float().to(t.dtype))
    params = inputs.receiver_params(CASE, 0)
    before = compare.snapshot(params)
    loader.load(mutant, params, payload_format, CASE, 0, version=1)
    with pytest.raises(judge.ConformanceError) as info:
        judge.check_rank(params, CASE, 0, 1, before)
    message = str(info.value)
    assert message.startswith("not a placement bug: only NaN payload bits differ ("), message
    assert "stages BF16 through FP32" in message and "gate/up" not in message
    assert "layer=" in message and "receiver_rank=0" in message


def test_the_same_harness_passes_the_unmodified_loader():
    """The control: identity conversion passes, so the failures above are the conversions'."""
    for fmt in FORMATS:
        params = inputs.receiver_params(CASE, 1)
        before = compare.snapshot(params)
        loader.load(LossyLoader(lambda t: t), params, fmt, CASE, 1, version=1)
        judge.check_rank(params, CASE, 1, 1, before)


# --- the value function itself -----------------------------------------------------------------


def _all_bits(version, spec=CASE.spec):
    full = synth.full_weights(spec, version)
    return torch.cat([w[p].reshape(-1) for experts in full.values() for w in experts
                      for p in ("gate", "up", "down")])


def test_values_span_every_pattern_a_lossy_conversion_changes():
    values = _all_bits(0)
    bits = values.view(torch.int16).to(torch.int64) & 0xFFFF
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    as_float = values.float()
    assert bool((bits == 0x0000).any()) and bool((bits == 0x8000).any()), "signed zeros"
    assert bool(((exponent == 0) & (mantissa != 0)).any()), "bf16 subnormals"
    assert bool(torch.isinf(as_float).any()), "infinities"
    nan = (exponent == 0xFF) & (mantissa != 0)
    assert len(set(mantissa[nan].tolist())) > 4, "NaNs with distinct payloads"
    assert bool((nan & (mantissa < 0x40)).any()), "signalling NaN payloads"
    finite = torch.isfinite(as_float) & (as_float != 0)
    assert bool((as_float[finite].abs() > 65504).any()), "beyond fp16's largest value"
    assert bool((as_float[finite].abs() < 2.0 ** -24).any()), "below fp16's smallest subnormal"
    for bit in range(7):
        used = (mantissa >> bit) & 1
        assert bool(used.any()) and not bool(used.all()), f"mantissa bit {bit} varies"


def test_every_element_differs_between_versions_specials_included():
    versions = list(range(6)) + [127, 128, 255]
    bits = {v: _all_bits(v).view(torch.int16) for v in versions}
    for a in versions:
        for b in versions:
            if a < b:
                same = int((bits[a] == bits[b]).sum())
                assert same == 0, f"versions {a} and {b} share {same} element(s)"


def test_finite_values_are_finite_nonzero_and_exact_in_fp16():
    full = synth.full_weights(CASE.spec, 2, finite=True)
    t = full[1][3].down
    assert bool(torch.isfinite(t.float()).all()) and bool((t != 0).all())
    assert torch.equal(t.half().bfloat16().view(torch.int16), t.view(torch.int16))
    fp16 = MoESpec(num_layers=1, num_experts=1, hidden=4, intermediate=4, dtype=torch.float16)
    assert bool(torch.isfinite(synth.full_weights(fp16, 0)[0][0].gate).all())


def test_values_depend_on_coordinates_not_on_evaluation_order():
    """Integer ops per element: the bits at a coordinate do not depend on which other
    coordinates are computed with it, or in which order."""
    rows, cols = torch.arange(5), torch.arange(7)
    a = synth.bf16_bits(3, 1, 0, 2, "down", rows, cols)
    b = synth.bf16_bits(3, 1, 0, 2, "down", rows.flip(0), cols).flip(0)
    assert torch.equal(a, b)


def _hash_in_python(seed, version, layer, expert, projection, row, col, finite=False):
    """The value function's bit pattern of one element, in plain unsigned Python arithmetic:
    the definition the vectorized int32 code must equal."""
    m32 = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m32
        x ^= x >> 15
        x = (x * 0x846CA68B) & m32
        return x ^ (x >> 16)

    key = synth._scalar_key(seed, layer, expert, projection)
    x = (key + row * 0x2545F491 + col * 0x9E3779B1) & m32
    x = mix(mix(x) ^ ((row << 20) & m32) ^ (col & m32))
    sign_mantissa = x & 0x807F
    if finite:
        return (sign_mantissa | ((0x71 + ((x >> 7) & 0xFF) % 30) << 7)) ^ synth.version_mask(version)
    bits = (sign_mantissa | ((1 + ((x >> 7) & 0xFF) % 254) << 7)) ^ synth.version_mask(version)
    slot = ((x >> 16) + version) & 0xFF
    rotated = 1 + ((x & 0x7F) + slot) % 127
    if slot < 2:
        return slot << 15
    if slot < 4:
        return 0x7F80 | ((slot - 2) << 15)
    if slot < 20:
        return (x & 0x8000) | rotated
    if slot < 36:
        return (x & 0x8000) | 0x7F80 | rotated
    return bits


@pytest.mark.parametrize("finite", [False, True])
def test_vectorized_value_function_equals_its_unsigned_definition(finite):
    """The int32 tensor code (wrapping multiplies, logical shifts) computes exactly the
    unsigned 32-bit hash, also for coordinates beyond 2**31 (a flat poison index)."""
    import random

    rng = random.Random(7)
    rows = torch.tensor([0, 1, 2, 3, 1000, 2**20 + 7, 2**31 - 1, 2**31 + 5, 2**33 + 3])
    cols = torch.tensor([0, 1, 511, 2047, 12345])
    for _ in range(12):
        seed, version, layer, expert = (rng.randrange(1 << 16), rng.randrange(300),
                                        rng.randrange(64), rng.randrange(512))
        projection = rng.choice(("gate", "up", "down"))
        got = synth.bf16_bits(seed, version, layer, expert, projection, rows, cols, finite)
        want = [[_hash_in_python(seed, version, layer, expert, projection, int(r), int(c),
                                 finite) for c in cols] for r in rows]
        assert (got & 0xFFFF).tolist() == want, (seed, version, layer, expert, projection)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_cached_blocks_are_the_same_bits_and_never_shared(dtype):
    """``expert_block`` serves small CPU blocks from a cache of whole blocks: any coordinates
    (out of order, repeated, a slice) give the bits the hash computes there, and the result
    is a new tensor, so a caller writing into it cannot change what the next one gets."""
    spec = MoESpec(num_layers=2, num_experts=3, hidden=6, intermediate=5, dtype=dtype)
    rows, cols = torch.tensor([4, 0, 4, 2]), torch.tensor([5, 1, 0])
    finite = dtype == torch.float16
    want = synth._bits_to_dtype(synth.bf16_bits(0, 2, 1, 2, "down", rows, cols, finite), dtype)
    first = synth.expert_block(spec, 2, 1, 2, "down", rows, cols)
    assert torch.equal(first.view(torch.uint8), want.view(torch.uint8))
    first.fill_(0)
    again = synth.expert_block(spec, 2, 1, 2, "down", rows, cols)
    assert torch.equal(again.view(torch.uint8), want.view(torch.uint8))
    # outside the block (a flat poison index): computed, not cached, still the hash
    far = torch.tensor([2**31 + 5])
    assert torch.equal(synth.expert_block(spec, 2, 1, 2, "down", far, cols).view(torch.uint8),
                       synth._bits_to_dtype(synth.bf16_bits(0, 2, 1, 2, "down", far, cols,
                                                            finite), dtype).view(torch.uint8))
