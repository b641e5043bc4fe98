"""Updates as bucket streams: what real senders send, loaded bit-exact, judged as a whole.

Real exporters cut an update at a byte limit (slime's ``update_weight_buffer_size``), so one
layer's experts straddle buckets and one bucket holds several layers. The reference
exporter's payload of every format, cut at every named limit (one tensor per bucket, a limit
that splits a layer's experts, one that puts several layers in a bucket, the whole update),
must land bit-exact in the reference receiver. Completeness is judged at ``end_update``: a
stream missing a bucket or one expert's ``up_proj`` is refused there with the missing
(layer, expert, projection) named; a piece carried twice, in two buckets or two spellings,
is refused at the bucket that repeats it, before that bucket writes anything.
"""

from __future__ import annotations

import functools

import pytest

from pytest_weightsync.vocabulary import BUCKET_LIMITS, FORMATS, LOAD_FORMAT

from ..harness import cases as matrix
from ..harness import inputs, judge, loader
from ..harness.inputs import bucket_bytes, fresh_receivers, gathered_weights, payload, stream
from ..harness.reference import check_receiver
from pytest_weightsync import compare
from pytest_weightsync.protocols import as_stream
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.senders.buckets import split_buckets
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model.layout import (MoESpec, ReceiverTopology, TrainerTopology,
                                                     hf_expert_name, parse_receiver_name)

pytestmark = pytest.mark.weightsync_property("bucket_streams")

#: Three layers, so "multi_layer" buckets really hold parts of several layers.
PADDED = matrix.Case(MoESpec(num_layers=3, num_experts=4, hidden=8, intermediate=8),
                     TrainerTopology(tp=2, ep=2, etp=2),
                     ReceiverTopology(tp=4, moe_ep=2, order="up_gate", intermediate_padded=5))
#: Every format at every limit on the three-layer case; every format at the limit that splits
#: layers on two more matrix anchors.
STREAM_CASES = ([pytest.param(PADDED, fmt, limit, id=f"L3-padded-upgate-{fmt}-{limit}")
                 for fmt in FORMATS for limit in BUCKET_LIMITS]
                + [pytest.param(case, fmt, "split_layer", id=f"{case.id}-{fmt}-split_layer")
                   for case in (matrix.ANCHORS[0], matrix.ANCHORS[2]) for fmt in FORMATS])


@functools.lru_cache(maxsize=8)
def _states(case, version):
    return trainer.trainer_states(case.spec, case.trainer, synth.full_weights(case.spec, version))


def _exported_stream(case, fmt, rank, version, limit):
    """The reference exporter's payload for receiver ``rank`` as a stream cut at ``limit``."""
    states = _states(case, version)
    result = ReferenceImplementation().export_weights(
        states, format=fmt, spec=case.spec, trainer=case.trainer, receiver=case.receiver,
        rank=rank)
    named = [pair for bucket in as_stream(result) for pair in bucket]
    return split_buckets(named, bucket_bytes(limit, case.spec))


def _layers(bucket):
    return {parse_receiver_name(name).layer for name, _ in bucket}


@pytest.mark.parametrize("case, fmt, limit", STREAM_CASES)
def test_exported_stream_lands_bit_exact_at_every_bucket_limit(case, fmt, limit):
    for rec in fresh_receivers(case):
        buckets = _exported_stream(case, fmt, rec.rank, 1, limit)
        before = compare.snapshot(rec.params)
        rec.begin_update()
        for bucket in buckets:
            rec.load(bucket, load_format=LOAD_FORMAT[fmt])
        rec.end_update()
        check_receiver(rec, case, 1, before)


def test_named_limits_cut_the_way_they_promise():
    """The limits mean what the suites rely on: split_layer cuts inside a layer's experts
    (per-expert format), multi_layer puts two layers in one bucket in every format."""
    full = gathered_weights(PADDED, 0)
    spec = PADDED.spec
    compat_split = stream("compat", PADDED, 0, bucket="split_layer", full=full)
    straddling = [b for b in compat_split
                  if {parse_receiver_name(n).expert for n, _ in b} != set(range(spec.num_experts))
                  and len({parse_receiver_name(n).expert for n, _ in b}) > 1]
    assert straddling, "split_layer never cut inside a layer"
    assert any(len({parse_receiver_name(n).projection for n, _ in b if
                    parse_receiver_name(n).expert == max(parse_receiver_name(m).expert
                                                         for m, _ in b)}) < 3
               for b in compat_split), "no bucket ends inside an expert"
    for fmt in FORMATS:
        rank = 0 if fmt != "direct" else 3
        multi = stream(fmt, PADDED, rank, bucket="multi_layer", full=full)
        assert any(len(_layers(b)) >= 2 for b in multi), f"{fmt}: no bucket with two layers"
        assert fmt == "direct" or len(multi) >= 2  # a rank's direct tensors are smaller
        assert all(len(b) == 1 for b in stream(fmt, PADDED, rank, bucket="tensor", full=full))
        assert len(stream(fmt, PADDED, rank, bucket="whole", full=full)) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_missing_a_bucket_is_refused_at_end_update(fmt):
    rank = 3  # experts 2..3, MoE-TP rank 1
    rec = fresh_receivers(PADDED)[rank]
    buckets = stream(fmt, PADDED, rank, bucket="tensor", full=gathered_weights(PADDED, 1))
    dropped = buckets.pop(len(buckets) // 2)
    rec.begin_update()
    for bucket in buckets:
        rec.load(bucket, load_format=LOAD_FORMAT[fmt])
    with pytest.raises(rx.MissingExpertError) as info:
        rec.end_update()
    parsed = parse_receiver_name(dropped[0][0])
    expert = parsed.expert if parsed.expert is not None else 2
    projection = {"w13": "gate", "gate_up": "gate", "w2": "down"}.get(parsed.projection,
                                                                      parsed.projection)
    assert f"layer {parsed.layer} expert {expert} {projection}_proj" in str(info.value)
    assert not rec.in_update


def test_stream_missing_one_up_proj_names_it():
    rank = 1  # experts 0..1, MoE-TP rank 1
    rec = fresh_receivers(PADDED)[rank]
    drop = hf_expert_name(2, 1, "up")
    buckets = stream("compat", PADDED, rank, bucket="split_layer", full=gathered_weights(PADDED, 1))
    buckets = [[(n, t) for n, t in b if n != drop] for b in buckets]
    rec.begin_update()
    for bucket in buckets:
        rec.load(bucket)
    with pytest.raises(rx.MissingExpertError,
                       match=r"receiver rank 1: .* 1 expert projection\(s\) this rank owns were "
                             r"never loaded: layer 2 expert 1 up_proj;"):
        rec.end_update()


@pytest.mark.parametrize("fmt", FORMATS)
def test_piece_repeated_in_a_later_bucket_is_refused_before_it_writes(fmt):
    rank = 2
    rec = fresh_receivers(PADDED)[rank]
    full = gathered_weights(PADDED, 1)
    buckets = stream(fmt, PADDED, rank, bucket="tensor", full=full)
    rec.begin_update()
    for bucket in buckets[:3]:
        rec.load(bucket, load_format=LOAD_FORMAT[fmt])
    before = compare.snapshot(rec.params)
    repeat = [buckets[3][0], buckets[1][0]]
    with pytest.raises(rx.DuplicateEntryError,
                       match=r"payload entry 1 of bucket 3 .*duplicate: .* already carried by "
                             r"entry 0 .* of bucket 1 in this update"):
        rec.load(repeat, load_format=LOAD_FORMAT[fmt])
    compare.assert_unchanged(before, rec.params, rank=rank)


def test_piece_repeated_under_another_format_is_refused():
    """hf_fused carries every expert's gate and up of a layer; a later per-expert gate_proj of
    that layer is the same piece again."""
    rec = fresh_receivers(PADDED)[0]
    full = gathered_weights(PADDED, 1)
    rec.begin_update()
    rec.load(payload("hf_fused", PADDED, 0, layers=[1], full=full))
    before = compare.snapshot(rec.params)
    with pytest.raises(rx.DuplicateEntryError, match=r"layer 1 expert 3 gate_proj was already "
                                                     r"carried by entry 0 "
                                                     r"'model\.layers\.1\.mlp\.experts\.gate_up_proj'"):
        rec.load(payload("compat", PADDED, 0, layers=[0], full=full) + [(hf_expert_name(1, 3, "gate"),
                                                             full[1][3].gate)])
    compare.assert_unchanged(before, rec.params, rank=0)


def test_refused_bucket_keeps_earlier_buckets_written():
    """The atomicity promise of a stream: a refused bucket writes nothing, earlier ones stay."""
    rec = fresh_receivers(PADDED)[0]
    full = gathered_weights(PADDED, 1)
    rec.begin_update()
    rec.load(payload("compat", PADDED, 0, layers=[0], full=full))
    before = compare.snapshot(rec.params)
    bad = payload("compat", PADDED, 0, layers=[1], full=full)
    bad[-1] = (bad[-1][0], bad[-1][1].float())
    with pytest.raises(rx.PayloadDtypeError):
        rec.load(bad)
    compare.assert_unchanged(before, rec.params, rank=0)
    expected = synth.expected_receiver_params(PADDED.spec, PADDED.receiver, 0, 1)
    name = "model.layers.0.mlp.experts.w13_weight"
    compare.assert_bitwise_equal(rec.params[name], expected[name], name=name)


@pytest.mark.parametrize("limit", ["tensor", "split_layer"])
def test_loader_hooks_frame_the_stream(limit):
    """The conformance harness calls a loader's begin_update/end_update around a full update;
    the reference implementation checks completeness there."""
    impl = ReferenceImplementation()
    case = PADDED
    for rank in range(case.receiver.tp):
        params = inputs.receiver_params(case, rank)
        before = compare.snapshot(params)
        loader.load(impl, params, "compat", case, rank, version=1, bucket=limit)
        judge.check_rank(params, case, rank, 1, before)
    params = inputs.receiver_params(case, 0)
    kwargs = dict(format="compat", spec=case.spec, topology=case.receiver, rank=0)
    impl.begin_update(params, **kwargs)
    for bucket in stream("compat", case, 0, 1, bucket=limit)[1:]:
        impl.load_weights(params, bucket, **kwargs)
    with pytest.raises(rx.MissingExpertError, match="layer 0 expert 0 gate_proj"):
        impl.end_update(params, **kwargs)
    with pytest.raises(rx.IncompleteUpdateError, match="without begin_update"):
        impl.end_update(params, **kwargs)


def test_split_buckets_cuts_like_a_sender():
    import torch

    t = [(str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate((4, 4, 9, 1, 2))]
    sizes = lambda buckets: [[len(x) for _, x in b] for b in buckets]  # noqa: E731
    assert sizes(split_buckets(t, 8)) == [[4, 4], [9], [1, 2]]
    assert sizes(split_buckets(t, 0)) == [[4], [4], [9], [1], [2]]
    assert sizes(split_buckets(t, None)) == [[4, 4, 9, 1, 2]]
    assert split_buckets([], 8) == [] and split_buckets([], None) == []
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="bucket_bytes must be None or an int >= 0"):
            split_buckets(t, bad)
