"""Stream state that cannot be misused: an open update is bound to its rank, topology, spec
and format; updates that are never ended do not pile up; messages number buckets the way the
sender does, refused buckets included.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from . import tensor_kind_probes as kp
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.impl import ReferenceImplementation, UpdateMismatchError
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
from pytest_weightsync.reference_impl.senders.formats import PayloadFormatError

KWARGS = dict(format="compat", spec=kp.SPEC, topology=kp.TOPOLOGY, rank=kp.RANK)
OTHER = {
    "rank": kp.RANK - 1,
    "topology": ReceiverTopology(tp=4, moe_ep=2),  # the same rank unpadded: same experts
    "spec": dataclasses.replace(kp.SPEC, num_layers=3),
    "format": "hf_fused",
}


@pytest.mark.parametrize("argument", sorted(OTHER))
def test_a_bucket_for_another_rank_topology_spec_or_format_is_refused(argument):
    """``begin_update(rank=3)`` then ``load_weights(rank=2)`` would place rank 2's experts in
    rank 3's buffers without a word; every bound argument is checked, and both values named."""
    impl, params = ReferenceImplementation(), kp.fresh_params()
    impl.begin_update(params, **KWARGS)
    other = dict(KWARGS, **{argument: OTHER[argument]})
    before = compare.snapshot(params)
    with pytest.raises(UpdateMismatchError) as info:
        impl.load_weights(params, kp.bucket("compat", [0]), **other)
    message = str(info.value)
    assert f"load_weights({argument}={OTHER[argument]!r})" in message, message
    assert f"begun with {argument}={KWARGS[argument]!r}" in message, message
    compare.assert_unchanged(before, params)
    with pytest.raises(UpdateMismatchError, match=rf"end_update\({argument}="):
        impl.end_update(params, **other)
    # the update is still open and still the rank's own
    for layer in range(kp.SPEC.num_layers):
        impl.load_weights(params, kp.bucket("compat", [layer]), **KWARGS)
    impl.end_update(params, **KWARGS)


def _live(kind) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


def test_updates_never_ended_are_released_when_their_params_are_dropped():
    impl = ReferenceImplementation()
    baseline = _live(rx.UpdateState)
    alive = []
    for _ in range(200):
        params = kp.fresh_params()
        alive.extend(weakref.ref(t) for t in params.values())
        impl.begin_update(params, **KWARGS)
        impl.load_weights(params, kp.bucket("compat", [0]), **KWARGS)
        del params  # the trainer gave up on this update (an exception, a retry)
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0, "abandoned updates keep their params"
    assert len(impl._open) == 0
    assert _live(rx.UpdateState) <= baseline


def test_an_update_never_ended_is_released_by_the_next_begin():
    impl, params = ReferenceImplementation(), kp.fresh_params()
    receiver = rx.ReferenceReceiver(kp.SPEC, kp.TOPOLOGY, kp.RANK)
    baseline = _live(rx.UpdateState)
    for _ in range(200):
        impl.begin_update(params, **KWARGS)
        impl.load_weights(params, kp.bucket("compat", [0]), **KWARGS)
        receiver.begin_update()
        receiver.load(kp.bucket("compat", [0]))
    assert len(impl._open) == 1
    assert _live(rx.UpdateState) <= baseline + 2
    # a fresh dict over the same tensors supersedes the update too (same parameters)
    impl.begin_update(dict(params), **KWARGS)
    assert len(impl._open) == 1
    state = weakref.ref(receiver.update_state)
    del receiver
    gc.collect()
    assert state() is None  # dropping the receiver drops its open update


def test_messages_number_buckets_as_the_sender_does():
    """Bucket 1 is refused (a float32 entry); the sender's next bucket is bucket 2, whatever
    the receiver accepted so far."""
    rec = rx.ReferenceReceiver(kp.SPEC, kp.TOPOLOGY, kp.RANK)
    rec.begin_update()
    rec.load(kp.bucket("compat", [0]))
    bad = kp.bucket("compat", [1])
    bad[0] = (bad[0][0], bad[0][1].float())
    with pytest.raises(rx.PayloadDtypeError, match="payload entry 0 of bucket 1 "):
        rec.load(bad)
    with pytest.raises(rx.UnknownNameError, match="payload entry 0 of bucket 2 'bogus'"):
        rec.load([("bogus", bad[1][1])])
    rec.load(kp.bucket("compat", [1]))
    with pytest.raises(rx.DuplicateEntryError, match=r"of bucket 4 .* already carried by entry "
                                                     r"\d+ .* of bucket 3 in this update"):
        rec.load(kp.bucket("compat", [1])[-1:])
    rec.end_update()


def test_buckets_the_implementation_refuses_itself_are_counted_too():
    impl, params = ReferenceImplementation(), kp.fresh_params()
    impl.begin_update(params, **KWARGS)
    impl.load_weights(params, kp.bucket("compat", [0]), **KWARGS)
    with pytest.raises(PayloadFormatError, match="payload entry 0 of bucket 1 .* not a name of "
                                                 "the compat format"):
        impl.load_weights(params, kp.bucket("packed", [1]), **KWARGS)
    with pytest.raises(UpdateMismatchError):
        impl.load_weights(params, kp.bucket("compat", [1]), **dict(KWARGS, rank=0))
    with pytest.raises(rx.PayloadTypeError, match="payload is None"):
        impl.load_weights(params, None, **KWARGS)
    bad = kp.bucket("compat", [1])
    bad[2] = (bad[2][0], torch.zeros(3))
    with pytest.raises(rx.PayloadError, match="payload entry 2 of bucket 4 "):
        impl.load_weights(params, bad, **KWARGS)
    with pytest.raises(rx.MissingExpertError, match=r"incomplete update \(5 bucket\(s\), 4 refused\)"):
        impl.end_update(params, **KWARGS)


def test_the_reference_still_pickles_to_trainer_ranks_after_updates():
    """The harness sends the registered implementation to trainer ranks by pickle: the
    per-parameter tables (weak references) stay behind, its settings travel."""
    import pickle

    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation
    from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology

    impl = ReferenceImplementation()
    impl.transport = "flattened_bucket"
    spec, topo = MoESpec(1, 2, 4, 2), ReceiverTopology()
    params = ReferenceReceiver(spec, topo, 0).params
    impl.begin_update(params, format="compat", spec=spec, topology=topo, rank=0)
    copy = pickle.loads(pickle.dumps(impl))
    assert copy.transport == "flattened_bucket"
    assert copy.weight_version(params, spec=spec, topology=topo, rank=0) is None
    assert impl._open and not copy._open


def test_an_update_of_the_same_cached_buckets_closes_without_comparing_every_piece_again():
    """A complete update's plans are remembered (weakly); the next update of the same cached
    plans, in the same order and nothing else offered, is complete without the comparison of
    every owed piece - and every other update still takes it: one bucket fewer, a refused
    bucket, another order, a plan that was dropped."""
    from pytest_weightsync.reference_impl.engine.receiver import MissingExpertError
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.senders.colocated import ColocatedSender

    spec = dataclasses.replace(kp.SPEC, num_layers=3)
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(spec, 4)
    sender = ColocatedSender("packed", spec, topo, full, bucket_bytes=1)  # a layer a bucket
    assert len(sender.buckets) == 3
    receiver = rx.ReferenceReceiver(spec, topo, 0, "cpu", plan_cache=True)
    compared = []
    real = frozenset.__le__

    class Owed(frozenset):  # counts end_update's comparisons with every piece the update saw
        def __le__(self, other):  # (a plan asked alone holds a third of them)
            if len(other) >= len(self):
                compared.append(1)
            return real(self, other)

    owed = Owed(receiver._owed_set())
    receiver._owed_set = lambda: owed

    def update(order, refuse=False):
        receiver.begin_update()
        if refuse:
            receiver.refuse_bucket()
        for index in order:
            receiver.load(sender.payload(index, 0))
        compared.clear()
        receiver.end_update()
        return len(compared)

    assert update([0, 1, 2]) == 1  # planned: compared, then remembered
    assert update([0, 1, 2]) == 0 and update([0, 1, 2]) == 0  # replayed: remembered
    assert update([2, 1, 0]) == 1  # another order: compared (and complete)
    assert update([0, 1, 2]) == 1 and update([0, 1, 2]) == 0
    with pytest.raises(MissingExpertError, match="layer 2 expert 0 gate_proj"):
        update([0, 1])
    assert update([0, 1, 2], refuse=True) == 1  # a bucket refused before: compared
    receiver.plan_cache = None  # fresh plans every bucket: never the same objects
    assert update([0, 1, 2]) == 1 and update([0, 1, 2]) == 1
    with pytest.raises(MissingExpertError):
        update([1, 2])
    gc.collect()  # the memo holds plans weakly: the uncached plans are gone with their buckets
    assert receiver._covered_by is not None and receiver._covered_by[1][0]() is None


def test_a_replayed_bucket_is_known_new_to_the_update_only_where_it_repeats_the_last_one():
    """The plan cache asks the receiver whether the open update so far repeats the last
    complete one plan for plan, this bucket's plan being that update's next
    (``follows_last_update``); then it skips hashing the bucket's pieces against the update's.
    Anything else - a bucket sent twice, another order, a refused bucket - is still checked,
    and a duplicate is still refused by name."""
    from pytest_weightsync.reference_impl.engine.payload_checks import DuplicateEntryError
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.senders.colocated import ColocatedSender

    spec = dataclasses.replace(kp.SPEC, num_layers=3)
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(spec, 5)
    sender = ColocatedSender("packed", spec, topo, full, bucket_bytes=1)  # a layer a bucket
    receiver = rx.ReferenceReceiver(spec, topo, 0, "cpu", plan_cache=True)
    answers = []
    follows = receiver.follows_last_update
    receiver.follows_last_update = lambda plan: answers.append(follows(plan)) or answers[-1]

    def update(order, refuse=False, end=True):
        answers.clear()
        receiver.begin_update()
        if refuse:
            receiver.refuse_bucket()
        for index in order:
            receiver.load(sender.payload(index, 0))
        if end:
            receiver.end_update()
        return answers

    assert update([0, 1, 2]) == []  # planned: nothing cached to replay
    assert update([0, 1, 2]) == [True, True]  # the last one, repeated: known new
    assert update([0, 2, 1]) == [False, False]  # another order: hashed (and complete)
    assert update([0, 1, 2]) == [False, False]  # not the order of the last one
    assert update([0, 1, 2]) == [True, True]
    with pytest.raises(DuplicateEntryError, match="duplicate"):
        update([0, 1, 1], end=False)  # the second bucket 1 is not the last update's third
    assert answers[0] is True and answers[1:] and not any(answers[1:])  # (asked per path)
    update([0, 1, 2])
    assert update([0, 1, 2], refuse=True) == [False, False]  # a bucket refused before them
