"""The reference FP8 block quantizer is the definition, and agrees with SGLang's.

``fp8.quantize`` is written from the definition (``fp8.py``); here it is checked three ways:

- against SGLang 0.5.23's own ``fp8_utils.per_block_cast_to_fp8`` (DeepGEMM's 128 x 128 UE8M0
  quantizer, pure torch, runs on CPU): bit-exact weights and scales with
  ``scale_format="ue8m0"``, whole blocks and partial ones;
- against the definition evaluated block by block with Python loops (amax over the block,
  ``amax / 448``, one cast per element), for several block sizes and partial blocks;
- on the suites' FP8 weights: neighbouring blocks, the two halves of ``w13`` and consecutive
  versions never share a scale (so a shifted or stale scale cannot pass), and dequantizing
  gives back every value within half an FP8 unit.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl.model import fp8
from pytest_weightsync.reference_impl.oracle import fp8 as fp8_oracle
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology

pytestmark = pytest.mark.weightsync_property("fp8_quantizer")

SPEC = MoESpec(1, 2, 10, 16)


def _weights(rows, cols, block, version=3):
    return fp8_oracle.source_block(MoESpec(1, 1, cols, rows), block, version, 0, 0, "gate",
                            torch.arange(rows), torch.arange(cols))


@pytest.mark.parametrize("rows, cols", [(256, 128), (300, 200)])
def test_ue8m0_variant_equals_sglang_per_block_cast_to_fp8(rows, cols):
    sglang_fp8 = pytest.importorskip("sglang.srt.layers.quantization.fp8_utils",
                                     reason="sglang is not importable")
    x = _weights(rows, cols, 128)
    q_sglang, s_sglang = sglang_fp8.per_block_cast_to_fp8(x)
    q, s = fp8.quantize(x, 128, "ue8m0")
    assert torch.equal(q.view(torch.uint8), q_sglang.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), s_sglang.view(torch.int32))


@pytest.mark.parametrize("block, rows, cols", [(4, 8, 10), (3, 7, 5), (128, 130, 129)])
def test_float_scales_are_the_definition_block_by_block(block, rows, cols):
    x = _weights(rows, cols, block)
    q, s = fp8.quantize(x, block)
    assert s.shape == (fp8.ceil_div(rows, block), fp8.ceil_div(cols, block))
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            tile = x[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block].float()
            amax = max(float(tile.abs().max()), fp8.AMAX_FLOOR)
            scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)
            assert torch.equal(s[bi, bj].view(torch.int32), scale.view(torch.int32)), (bi, bj)
            want = (tile / scale).clamp(-448, 448).to(fp8.FP8)
            got = q[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (bi, bj)
    # the largest element of every block lands on the largest FP8 value
    assert float(q.float().abs().max()) == 448.0


def test_suite_weights_give_every_neighbour_and_version_its_own_scale():
    topo = ReceiverTopology(weight_quant="fp8_block", quant_block=(4, 4))
    scales = {}
    for version in (1, 2):
        full = fp8_oracle.source_weights(SPEC, topo, version)
        for key, qt in fp8.quantize_full(full, 4).items():
            s = qt.scale_inv
            scales[(version, *key)] = s
            if s.shape[0] > 1:
                assert not (s[1:] == s[:-1]).any(), f"{key}: row neighbours share a scale"
            if s.shape[1] > 1:
                assert not (s[:, 1:] == s[:, :-1]).any(), f"{key}: column neighbours share a scale"
            x = full[key[0]][key[1]][key[2]].float()
            err = (fp8.dequantize(qt.weight, s, 4) - x).abs()
            unit = fp8.fp8_ulp(qt.weight) * fp8.dequantize(
                torch.ones(qt.weight.shape).to(fp8.FP8), s, 4)
            # round to nearest: at most half a unit (ties exactly half, up to float rounding)
            assert bool((err <= 0.5 * unit * (1 + 1e-5)).all()), key
    for (version, layer, expert, projection), s in scales.items():
        if version == 1:
            assert not (s == scales[(2, layer, expert, projection)]).any(), \
                f"{(layer, expert, projection)}: a scale unchanged between versions"
        if projection == "gate" and version == 1:
            up = scales[(1, layer, expert, "up")]
            assert not (s == up).all(), "gate and up share their scales"
