"""A loader that defers its copies without cloning is caught by ``no_stale_values``, and named.

Real senders refill their staging buffer (a flattened bucket, an IPC buffer) with the next
bucket's bytes as soon as the engine's load returns (ms-swift#10204); with the
``flattened_bucket`` transport the one flat buffer of each bucket is refilled. The mutant is the
reference loader with its copies deferred to ``end_update``: it keeps references to each
bucket's tensors and copies them at the end - right when nobody touches the buffers, wrong
under a real sender. The harness refills every bucket after ``load_weights`` returns, so the
mutant must fail with "deferred copy", located; the same mutant that clones what it keeps
must pass.
"""

from __future__ import annotations

import pytest

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

from ..harness import inputs, judge, loader
from ..harness.cases import ANCHORS

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: EP 2 x TP 2 receiver, 3 experts per rank, odd sizes.
CASE = ANCHORS[5]


class DefersCopies(ReferenceImplementation):
    """Keeps every bucket and loads them all at ``end_update``."""

    name = "mutant-deferred-copy"
    clone = False

    def begin_update(self, params, **kwargs):
        self.kept = []
        super().begin_update(params, **kwargs)

    def load_weights(self, params, payload, **kwargs):
        from pytest_weightsync import wire

        if wire.transport_of(payload) == "flattened_bucket":  # views into the flat buffer
            payload = wire.decode_flattened(payload)
        self.kept.append([(n, t.clone() if self.clone else t) for n, t in payload])

    def end_update(self, params, **kwargs):
        for bucket in self.kept:
            super().load_weights(params, bucket, **kwargs)
        super().end_update(params, **kwargs)


class DefersClonedCopies(DefersCopies):
    name = "mutant-deferred-clone"
    clone = True


def _update(impl, version=1, transport="tensors"):
    params = inputs.receiver_params(CASE, 0)
    loader.load_and_check(impl, params, "compat", CASE, 0, version,
                          before=compare.snapshot(params), bucket="split_layer",
                          transport=transport)


@pytest.mark.parametrize("transport", ["tensors", "flattened_bucket"])
def test_a_deferred_copy_of_refilled_buckets_is_killed_and_named(transport):
    with pytest.raises(judge.ConformanceError) as info:
        _update(DefersCopies(), transport=transport)
    message = str(info.value)
    assert message.startswith("deferred copy: mutant-deferred-copy read bucket tensors after "
                              "its load_weights call returned"), message
    assert "first at layer=0 expert=0 projection=" in message, message


def test_a_deferred_copy_of_clones_passes():
    _update(DefersClonedCopies())


@pytest.mark.parametrize("transport", ["tensors", "flattened_bucket"])
def test_the_reference_loader_passes_with_refilled_buckets(transport):
    _update(ReferenceImplementation(), version=2, transport=transport)
