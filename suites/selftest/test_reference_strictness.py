"""The reference receiver is the strict yardstick: every bad kind of the hardening probe is
refused, nothing of the refused bucket is written, and the error names the problem."""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import FORMATS

from ..harness import hardening


@pytest.mark.weightsync_property("reference_strictness")
@pytest.mark.parametrize("kind", hardening.KINDS)
@pytest.mark.parametrize("payload_format", FORMATS)
def test_reference_refuses_every_bad_kind(kind, payload_format):
    """The reference receiver is the strict yardstick: every bad kind is refused, nothing of
    the refused bucket written, and the error names the problem."""
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation

    impl = ReferenceImplementation()
    for topology_class in sorted(hardening.CLASSES):
        case, _ = hardening.case_for(impl, topology_class, payload_format)
        rank = case.receiver.world_size - 1
        finding, bad = hardening.probe(impl, kind, payload_format, case, rank)
        assert finding.refused, (f"reference on {case.id} rank {rank}, {payload_format} "
                                 f"{kind}: {finding.key}: {finding.detail}")
        message = str(finding.error).lower()
        missing = [w for w in bad.words if w.lower() not in message]
        assert not missing, (f"reference refused {payload_format} {kind} on {case.id} rank "
                             f"{rank} without naming the problem (lacks {missing}): "
                             f"{finding.detail}")
