"""Conformance of every registered exporter (``export_weights``) to the reference, bit for bit.

Each test runs once per registered implementation with an exporter role. The exporter gets
every trainer rank's Megatron-Core expert shards of the matrix topology; its payload for each
receiver rank is loaded by the reference receiver (which validates names, shapes, dtypes and
completeness) and the result compared with the expected state in every bit.

- ``export_bit_exact``: every format it claims, every topology it claims; the trainer shards
  are left bit-identical;
- ``fallback_routing``: with a capability taken away, the routed path lands bit-exact too.
"""

from __future__ import annotations

import pytest

import conformance_harness as ch
import matrix
from harness import LOAD_FORMAT, fresh_receivers
from pytest_weightsync import compare
from reference_impl import synth, trainer


def _trainer_states(case, version):
    full = synth.full_weights(case.spec, version)
    return trainer.trainer_states(case.spec, case.trainer, full)


def export_and_check(exporter, case, fmt, version):
    states = _trainer_states(case, version)
    shards_before = [compare.snapshot(state) for state in states]
    for receiver in fresh_receivers(case):
        before = compare.snapshot(receiver.params)
        chunk = exporter.export_weights(states, format=fmt, spec=case.spec, trainer=case.trainer,
                                        receiver=case.receiver, rank=receiver.rank)
        receiver.begin_update()
        receiver.load(list(chunk), load_format=LOAD_FORMAT[fmt])
        receiver.end_update()
        ch.check_receiver(receiver, case, version, before)
    for rank, (before, state) in enumerate(zip(shards_before, states)):
        try:
            compare.assert_unchanged(before, state)
        except AssertionError as error:
            raise ch.ConformanceError(f"export modified trainer rank {rank}'s shards:\n"
                                      f"{error}") from None


def _require_claim(impl, case, fmt=None):
    ch.require_claim(impl, "exporter", case, fmt)


@pytest.mark.weightsync_property("export_bit_exact")
@pytest.mark.parametrize("payload_format", ch.FORMATS)
def test_exporter_payload_lands_bit_exact(weightsync_exporter, moe_case, payload_format):
    _require_claim(weightsync_exporter, moe_case, payload_format)
    export_and_check(weightsync_exporter, moe_case, payload_format, version=1)


@pytest.mark.weightsync_property("fallback_routing")
@pytest.mark.parametrize("restriction", sorted(ch.RESTRICTIONS))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in matrix.ANCHORS])
def test_exporter_fallback_path_lands_bit_exact(weightsync_exporter, case, restriction):
    choice = ch.fallback_choice(weightsync_exporter, "exporter", case, restriction)
    export_and_check(weightsync_exporter, case, choice.path, version=4)
