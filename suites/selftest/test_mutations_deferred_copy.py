"""A loader that defers its copies without cloning is caught by ``no_stale_values``, and named.

Real senders refill their staging buffer (a flattened bucket, an IPC buffer) with the next
bucket's bytes as soon as the engine's load returns (ms-swift#10204); with the
``flattened_bucket`` transport the one flat buffer of each bucket is refilled. The mutant is the
reference loader with its copies deferred to ``end_update``: it keeps references to each
bucket's tensors and copies them at the end - right when nobody touches the buffers, wrong
under a real sender. The harness refills every bucket after ``load_weights`` returns, so the
mutant must fail with "deferred copy", located; the same mutant that clones what it keeps
must pass.

Its twin, a loader that copies too little rather than too late: a cache keyed by layout
(each tensor's name, shape and dtype and the parameters' addresses) that skips a copy it has
"seen" serves the previous version whenever an update keeps the layout (vllm#59647: a weight
cache fingerprinting names and headers, not values, served a fine-tune). The same
``no_stale_values`` check kills it, named "served by layout, values stale" - never "deferred
copy", although fresh buffers (new addresses) would let it land.
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


class ServedByLayout(ReferenceImplementation):
    """Skips every tensor whose layout key - (name, shape, dtype) and the addresses of the
    parameters it goes to - it has loaded before."""

    name = "mutant-served-by-layout"
    begin_update = end_update = None  # a plain loader: each bucket stands alone

    def __init__(self):
        super().__init__()
        self.seen = set()

    def load_weights(self, params, payload, **kwargs):
        where = tuple((n, t.data_ptr(), tuple(t.shape), t.dtype) for n, t in params.items())
        keys = [(where, name, tuple(t.shape), t.dtype) for name, t in payload]
        fresh = [pair for pair, key in zip(payload, keys) if key not in self.seen]
        self.seen.update(keys)
        super().load_weights(params, fresh, **kwargs)


def test_a_cache_keyed_by_layout_is_killed_and_named_stale():
    from ..conformance import test_loader

    with pytest.raises(judge.ConformanceError) as info:
        test_loader.test_loader_repeated_updates_leave_no_stale_value(ServedByLayout(), CASE,
                                                                      "compat")
    message = str(info.value)
    assert message.startswith("served by layout, values stale: mutant-served-by-layout took a "
                              "full update to version 2"), message[:600]
    assert "stale: it still holds the previous version's values" in message, message[:1500]
