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

from pytest_weightsync.vocabulary import FORMATS

from ..harness import cases, claims, exporter


def _require_claim(impl, case, fmt=None):
    claims.require_claim(impl, "exporter", case, fmt)


@pytest.mark.weightsync_property("export_bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
def test_exporter_payload_lands_bit_exact(weightsync_exporter, moe_case, payload_format):
    _require_claim(weightsync_exporter, moe_case, payload_format)
    exporter.export_and_check(weightsync_exporter, moe_case, payload_format, version=1)


@pytest.mark.weightsync_property("export_bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
def test_exporter_payload_of_a_realistic_layer_lands_bit_exact(weightsync_exporter,
                                                              payload_format):
    """36 MiB an update from a TP 2 x EP 2 x ETP 2 trainer (``cases.REALISTIC``)."""
    _require_claim(weightsync_exporter, cases.REALISTIC, payload_format)
    exporter.export_and_check(weightsync_exporter, cases.REALISTIC, payload_format, version=1)


@pytest.mark.weightsync_property("fallback_routing")
@pytest.mark.parametrize("restriction", sorted(claims.RESTRICTIONS))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id)
                                  for c in (*cases.ANCHORS, cases.REALISTIC)])
def test_exporter_fallback_path_lands_bit_exact(weightsync_exporter, case, restriction):
    _require_claim(weightsync_exporter, case)
    choice = claims.fallback_choice(weightsync_exporter, "exporter", case, restriction)
    exporter.export_and_check(weightsync_exporter, case, choice.path, version=4)
