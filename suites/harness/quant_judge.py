"""Judging a loader that quantizes: dequantized values within one FP8 unit of the reference.

When the loader quantizes (``QUANTIZERS`` ``"loader"``), its rounding may differ from the
reference quantizer's in the last bit (a reciprocal multiply instead of a division), so its
bits are not the property. What SGLang's weight checker and slime's
``--check-weight-update-allow-quant-error`` compare is the dequantized value ``q *
scale_inv``: every element must be within one float8_e4m3fn unit in the last place (at the
reference's scale) of the reference's dequantized value. A scale of the wrong block, of the
previous version, or weights quantized with the wrong block grid are far outside that (the
suites' weights give every block its own power of two). Addresses are checked as everywhere.
"""

from __future__ import annotations

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model import fp8

from . import inputs
from .judge import ConformanceError


def check_dequantized(params, case, rank, version, before=None,
                      previous_version=None) -> None:
    """Every FP8 weight of receiver ``rank``, read with its scales, within one FP8 unit of the
    reference's dequantized ``version``; raises :class:`ConformanceError` naming the first
    element outside (layer, expert, projection, row, col) and by how many units."""
    if before is not None:
        compare.assert_same_storage(before, params, rank=rank)
    expected = inputs.expected(case, rank, version)
    block = fp8.block_of(case.receiver)
    locate = inputs.locator(case, rank)
    for name in (n for n in expected if not n.endswith(fp8.SCALE_SUFFIX)):
        scale = name + fp8.SCALE_SUFFIX
        got = fp8.dequantize(params[name], params[scale], block)
        want = fp8.dequantize(expected[name], expected[scale], block)
        # one unit of the reference's element, at the reference's block scale
        unit = fp8.fp8_ulp(expected[name]) * fp8.dequantize(_ones_like_fp8(expected[name]),
                                                            expected[scale], block)
        excess = (got - want).abs() / unit
        bad = excess > 1.0
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            where = locate(name, index)
            from . import engine_diagnosis

            old = (inputs.expected(case, rank, previous_version)[scale]
                   if previous_version is not None else None)
            named = engine_diagnosis.diagnose(scale, params[scale], expected[scale], case, rank,
                                              version, previous=old)
            hint = "" if named is None else named + "\n"
            raise ConformanceError(
                f"{hint}dequantized values off by more than one FP8 unit: {int(bad.sum())} of "
                f"{bad.numel()} elements of {name} on receiver rank {rank}; first at {where} "
                f"({name}{list(index)}): got {float(got[index])!r}, reference "
                f"{float(want[index])!r} ({float(excess[index]):.1f} units at the reference "
                f"scale)")


def _ones_like_fp8(q):
    import torch

    return torch.ones(q.shape, dtype=torch.float32, device=q.device).to(q.dtype)
