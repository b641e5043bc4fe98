"""Conformance of every registered exporter (``export_weights``) to the reference, bit for bit.

Each test runs once per registered implementation with an exporter role. The exporter gets
every trainer rank's Megatron-Core expert shards of the matrix topology; its payload for each
receiver rank is loaded by the reference receiver (which validates names, shapes, dtypes and
completeness) and the result compared with the expected state in every bit.

- ``export_bit_exact``: every format it claims, every topology it claims (receiver and trainer
  side: expert module spelling, trainer parallel sizes); after EVERY export call the trainer
  shards are checked bit-identical, and a change fails at that call naming the receiver rank
  of the call, the trainer rank, the shard and the first changed row/col;
- ``fallback_routing``: with a capability taken away, the routed path lands bit-exact too.
"""

from __future__ import annotations

import pytest

from . import conformance_harness as ch
from . import matrix
from .harness import LOAD_FORMAT, fresh_receivers
from pytest_weightsync import compare, distributed
from pytest_weightsync.protocols import as_stream
from pytest_weightsync.reference_impl import synth, trainer


def _trainer_states(case, version):
    full = synth.full_weights(case.spec, version)
    return trainer.trainer_states(case.spec, case.trainer, full)


def export_and_check(exporter, case, fmt, version):
    """Export ``version`` for every receiver rank (one call per rank), checking after EVERY
    call that no trainer shard changed - before the receiver's values are judged, so the
    failure names the call that did it - then load and judge that rank."""
    states = _trainer_states(case, version)
    shards_before = [distributed.snapshot(state) for state in states]
    for receiver in fresh_receivers(case):
        before = compare.snapshot(receiver.params)
        chunk = exporter.export_weights(states, format=fmt, spec=case.spec, trainer=case.trainer,
                                        receiver=case.receiver, rank=receiver.rank)
        for rank, (shards, state) in enumerate(zip(shards_before, states)):
            where = distributed.first_modification(shards, state)
            if where is not None:
                raise ch.ConformanceError(f"export call for receiver rank {receiver.rank} "
                                          f"({fmt}) modified trainer rank {rank}'s shard {where}")
        receiver.begin_update()
        for bucket in as_stream(chunk, source=f"{exporter.name}.export_weights"):
            receiver.load(list(bucket), load_format=LOAD_FORMAT[fmt])
        receiver.end_update()
        ch.check_receiver(receiver, case, version, before)


def _require_claim(impl, case, fmt=None):
    ch.require_claim(impl, "exporter", case, fmt)
    reason = impl.capabilities.trainer_refusal(case.spec, case.trainer)
    if reason is not None:
        pytest.skip(f"{impl.name} {reason}")


@pytest.mark.weightsync_property("export_bit_exact")
@pytest.mark.parametrize("payload_format", ch.FORMATS)
def test_exporter_payload_lands_bit_exact(weightsync_exporter, moe_case, payload_format):
    _require_claim(weightsync_exporter, moe_case, payload_format)
    export_and_check(weightsync_exporter, moe_case, payload_format, version=1)


@pytest.mark.weightsync_property("fallback_routing")
@pytest.mark.parametrize("restriction", sorted(ch.RESTRICTIONS))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in matrix.ANCHORS])
def test_exporter_fallback_path_lands_bit_exact(weightsync_exporter, case, restriction):
    _require_claim(weightsync_exporter, case)
    choice = ch.fallback_choice(weightsync_exporter, "exporter", case, restriction)
    export_and_check(weightsync_exporter, case, choice.path, version=4)
