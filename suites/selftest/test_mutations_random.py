"""Bugs that only some topologies or bucket cuts expose are caught by the randomized suite.

Each mutant is the reference loader with one planted bug, handed to the unchanged test
function of ``test_conformance_random`` in place of a registered implementation: the drawn
topologies and bucket limits must reach the case that exposes it, and the failure must name
the case, the bucket limit and the element.
"""

from __future__ import annotations

import pytest

from ..conformance import test_random as random_suite
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

pytestmark = pytest.mark.weightsync_property("mutation_detected")


class TransposesSquareBlocks(ReferenceImplementation):
    """Transposes every tensor whose last two dims are equal (``.T`` where a reshape was
    meant): invisible by shape, visible only where a per-rank block is square."""

    name = "transposes_square_blocks"

    def load_weights(self, params, payload, **kwargs):
        payload = [(n, t.transpose(-1, -2).contiguous() if t.dim() >= 2 and t.shape[-1] == t.shape[-2]
                    and t.shape[-1] > 1 else t) for n, t in payload]
        super().load_weights(params, payload, **kwargs)


class DropsLastEntryOfBigBuckets(ReferenceImplementation):
    """Loads every entry of a bucket but the last (an off-by-one loop bound), and skips the
    completeness check: fine while every bucket holds one tensor."""

    name = "drops_last_entry"

    def load_weights(self, params, payload, **kwargs):
        payload = list(payload)
        super().load_weights(params, payload[:-1] if len(payload) > 1 else payload, **kwargs)

    def end_update(self, params, **kwargs):
        self._open.pop(id(params), None)


@pytest.mark.parametrize("mutant", [TransposesSquareBlocks, DropsLastEntryOfBigBuckets],
                         ids=lambda cls: cls.name)
def test_randomized_suite_catches_the_mutant_with_a_location(mutant, monkeypatch):
    from hypothesis import Phase, settings

    # the same draws, without shrinking the failure (a user wants it shrunk; this test only
    # wants it found, fast)
    monkeypatch.setattr(random_suite, "PROFILE",
                        settings(random_suite.PROFILE, phases=[Phase.explicit, Phase.generate]))
    with pytest.raises(AssertionError) as info:
        random_suite.test_loader_on_drawn_topologies_and_buckets(mutant())
    message = str(info.value)
    for word in ("format=", "bucket_bytes=", "receiver rank", "layer=", "expert=",
                 "projection="):
        assert word in message, message
