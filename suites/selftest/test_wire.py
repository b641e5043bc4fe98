"""The harness's wire decoders and the reference's encoders, held against SGLang's own code.

SGLang 0.5.23 decodes a flattened bucket with ``FlattenedTensorBucket.reconstruct_tensors``,
a serialized update with ``MultiprocessingSerializer.deserialize`` (``SafeUnpickler``) and
``LocalSerializedTensor.get``, and lays out a flattened broadcast with
``FlattenedTensorBucket.empty``. Here every one of them and the harness's
(:mod:`pytest_weightsync.wire`, :mod:`pytest_weightsync.transports.broadcast`) must read the same bytes
the same way - on fuzzed buckets of strided, transposed, 0-d and empty views and mixed dtypes
with odd element counts - and refuse the same broken ones. Where SGLang's own encoder fails
(a strided 1-D view: verl#6919 / sglang#39535; an empty bucket: slime#2134; mixed dtypes
packed densely: verl#7318), the test shows it failing and the reference's encoder not.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_weightsync import wire
from pytest_weightsync.transports.broadcast import WireFormatError as BroadcastFormatError
from pytest_weightsync.transports.broadcast import announced, dense_offsets
from pytest_weightsync.reference_impl.senders.buckets import split_buckets

from .sharer import drop_unfetched_shares

tensor_bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket",
                                    reason="sglang is not importable")
FlattenedTensorBucket = tensor_bucket.FlattenedTensorBucket
FlattenedTensorMetadata = tensor_bucket.FlattenedTensorMetadata

DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64, torch.uint8)
#: How a tensor of a bucket is viewed: as it is, transposed, strided, a 0-d element, empty.
VIEWS = ("plain", "transposed", "strided", "scalar", "empty")


def _view(kind: str, dtype, rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(-100, 100, (rows + 1, 2 * cols + 1), generator=gen).to(dtype)
    if kind == "transposed":
        return base[:rows, :cols].T
    if kind == "strided":
        return base[0, ::2][:cols]
    if kind == "scalar":
        return base[0, 0]
    if kind == "empty":
        return base[:0, :cols]
    return base[:rows, :cols].clone()


@st.composite
def buckets(draw, max_size=6):
    count = draw(st.integers(0, max_size))
    return [(f"model.layers.{i}.w", _view(draw(st.sampled_from(VIEWS)),
                                          draw(st.sampled_from(DTYPES)),
                                          draw(st.integers(1, 5)), draw(st.integers(1, 5)),
                                          draw(st.integers(0, 2**16))))
            for i in range(count)]


def _same(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), name
        # float64 holds every value the buckets hold exactly (small ints, bf16, fp16, fp32)
        assert torch.equal(a.double(), b.double()), name


def _sglang_reconstruct(payload):
    return FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                 metadata=payload["metadata"]).reconstruct_tensors()


@settings(max_examples=60, deadline=None)
@given(buckets())
def test_the_reference_encoding_reads_the_same_through_sglang_and_the_harness(bucket):
    payload = wire.flattened_bucket(bucket, meta_type=FlattenedTensorMetadata)
    _same(wire.decode_flattened(payload), bucket)
    _same(_sglang_reconstruct(payload), bucket)
    for meta in payload["metadata"]:  # every offset aligned, whatever precedes it
        assert meta.start_idx % meta.dtype.itemsize == 0


@settings(max_examples=60, deadline=None)
@given(buckets())
def test_sglang_encodings_decode_alike_or_are_refused_alike(bucket):
    """SGLang's own encoder packs densely: where that leaves an offset unaligned, its own
    decoder raises and the harness refuses the bucket naming the entry; elsewhere both read
    the same tensors. Where its encoder cannot encode (strided 1-D views, nothing at all),
    the reference's encoding is the one that travels."""
    try:
        encoded = FlattenedTensorBucket(named_tensors=bucket)
    except (RuntimeError, ValueError):
        # only where flatten() leaves a non-unit stride (a strided 1-D view, a transposed
        # view with a size-1 dim), which view(torch.uint8) cannot take
        assert not bucket or any(t.numel() and t.flatten().stride(0) != 1 for _, t in bucket)
        return
    payload = {"flattened_tensor": encoded.get_flattened_tensor(),
               "metadata": encoded.get_metadata()}
    try:
        theirs = _sglang_reconstruct(payload)
    except RuntimeError:
        with pytest.raises(wire.WireFormatError, match="verl#7318"):
            wire.decode_flattened(payload)
        return
    _same(wire.decode_flattened(payload), bucket)
    _same(theirs, bucket)


def test_sglang_encoder_fails_where_the_reference_encoder_does_not():
    strided = [("w", torch.arange(8, dtype=torch.bfloat16)[::2])]
    with pytest.raises(RuntimeError, match="stride"):
        FlattenedTensorBucket(named_tensors=strided)
    with pytest.raises(ValueError, match="empty"):
        FlattenedTensorBucket(named_tensors=[])
    _same(wire.decode_flattened(wire.flattened_bucket(strided)), strided)
    empty = wire.flattened_bucket([], meta_type=FlattenedTensorMetadata)
    assert wire.decode_flattened(empty) == [] and _sglang_reconstruct(empty) == []


@pytest.mark.parametrize("damage, pattern", [
    (lambda m: m.__class__(m.name, m.shape, m.dtype, m.start_idx, m.end_idx - 2, m.numel - 2),
     "needs"),
    (lambda m: m.__class__(m.name, m.shape, m.dtype, m.start_idx + 1000, m.end_idx + 1000,
                           m.numel), "outside"),
    (lambda m: m.__class__(m.name, m.shape, "bf16", m.start_idx, m.end_idx, m.numel),
     "not a torch.dtype"),
])
def test_broken_metadata_is_refused_naming_the_entry(damage, pattern):
    bucket = [("a", torch.ones(3, dtype=torch.int8)), ("b", torch.ones(2, 3))]
    payload = wire.flattened_bucket(bucket, meta_type=FlattenedTensorMetadata)
    payload["metadata"][1] = damage(payload["metadata"][1])
    with pytest.raises(wire.WireFormatError, match=f"entry 1 'b'.*{pattern}"):
        wire.decode_flattened(payload)


def test_a_flat_tensor_that_is_not_bytes_is_refused():
    payload = wire.flattened_bucket([("a", torch.ones(4))])
    with pytest.raises(wire.WireFormatError, match="1-D uint8"):
        wire.decode_flattened({**payload, "flattened_tensor": torch.ones(16)})


def test_a_tensor_larger_than_the_bucket_limit_travels_whole():
    """A parameter larger than the staging buffer (NeMo-RL#3356) is a bucket of its own, and
    its flattened bucket is larger than the limit: decoded whole, not cut."""
    big = torch.arange(96, dtype=torch.float32).reshape(8, 12)
    stream = split_buckets([("small", torch.ones(2)), ("big", big), ("tail", torch.ones(3))],
                           bucket_bytes=64)
    assert [len(b) for b in stream] == [1, 1, 1]
    decoded = [wire.decode_flattened(wire.flattened_bucket(b)) for b in stream]
    _same(decoded[1], [("big", big)])


def test_sglang_serialized_updates_decode_as_its_tp_worker_reads_them():
    """verl's and ``sglang.srt.weight_sync.utils``'s payload: the same list serialized once
    per TP rank, each tensor a ``LocalSerializedTensor`` of one serialized value per rank."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    per_rank = [[("w", torch.full((2, 3), float(r))), ("b", torch.arange(r + 1))]
                for r in range(2)]
    named = [(name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(
        per_rank[r][i][1]) for r in range(2)])) for i, (name, _) in enumerate(per_rank[0])]
    update = wire.TensorUpdate([MultiprocessingSerializer.serialize(named, output_str=True)
                                for _ in range(2)])
    try:
        for rank in range(2):
            got, load_format = wire.decode_serialized(update, engine_rank=rank, engine_tp=2)
            assert load_format is None
            _same(got, per_rank[rank])
        with pytest.raises(wire.WireFormatError, match="one per engine TP rank \\(4\\)"):
            wire.decode_serialized(update, engine_rank=0, engine_tp=4)
    finally:
        drop_unfetched_shares()


@pytest.mark.parametrize("flattened", [False, True], ids=["tensors", "flattened"])
def test_the_reference_serialized_update_passes_sglangs_safe_unpickler(flattened):
    from sglang.srt.utils import MultiprocessingSerializer

    bucket = [("a", torch.arange(5, dtype=torch.bfloat16)), ("b", torch.ones(3, 2).T)]
    update = wire.serialized_update([bucket, []], flattened=flattened, as_str=True,
                                    meta_type=FlattenedTensorMetadata)
    try:
        theirs = MultiprocessingSerializer.deserialize(update.serialized_named_tensors[0])
        _same(_sglang_reconstruct(theirs) if flattened else theirs, bucket)
        ours, _ = wire.decode_serialized(
            wire.serialized_update([bucket, []], flattened=flattened), engine_rank=0,
            engine_tp=2)
        _same(ours, bucket)
    finally:
        drop_unfetched_shares()


def test_harness_metadata_outside_sglang_is_refused_by_its_unpickler():
    """Why :func:`pytest_weightsync.wire.metadata_type` exists: SGLang admits only its own
    metadata class, so a payload a real engine unpickles carries that one."""
    from sglang.srt.utils import MultiprocessingSerializer

    update = wire.serialized_update([[("a", torch.ones(2))]], flattened=True)
    try:
        with pytest.raises(RuntimeError, match="Blocked unsafe global"):
            MultiprocessingSerializer.deserialize(update.serialized_named_tensors[0])
        assert wire.metadata_type() is FlattenedTensorMetadata
    finally:
        drop_unfetched_shares()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.lists(st.integers(0, 4), min_size=0, max_size=3)),
                max_size=6))
def test_dense_broadcast_offsets_agree_with_sglangs_receive_bucket(entries):
    names = [f"t{i}" for i in range(len(entries))]
    dtypes = [d for d, _ in entries]
    shapes = [s for _, s in entries]
    try:
        theirs = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    except ValueError as error:
        if "empty" in str(error):
            assert not entries
            return
        with pytest.raises(BroadcastFormatError, match="verl#7318"):
            dense_offsets(announced(names, dtypes, shapes))
        return
    ours = dense_offsets(announced(names, dtypes, shapes))
    assert ours[:-1] == [m.start_idx for m in theirs.get_metadata()]
    assert ours[-1] == theirs.get_flattened_tensor().numel()


# --- the broadcast engine, in this process ------------------------------------------------------

def _send(engine, tensors) -> None:
    import torch.distributed as dist

    for tensor in tensors:
        engine.group.broadcast([tensor], dist.BroadcastOptions()).wait()


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_broadcast_engine_ranks_receive_what_was_announced(load_format):
    import threading

    from torch.distributed import distributed_c10d as c10d

    from pytest_weightsync.transports.broadcast import BroadcastEngine

    bucket = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
              ("b", torch.arange(3, dtype=torch.bfloat16))]
    engine = BroadcastEngine(2, timeout=10)
    try:
        engine.update_weights_from_distributed([n for n, _ in bucket], [t.dtype for _, t in bucket],
                                               [t.shape for _, t in bucket],
                                               load_format=load_format)
        if load_format is None:
            _send(engine, [t for _, t in bucket])
        else:
            _send(engine, [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])])
        streams = engine.finish()
        group = engine.group
    finally:
        engine.close()
    assert sorted(streams) == [0, 1]
    for stream in streams.values():
        assert len(stream) == 1
        _same(stream[0], bucket)
    assert group not in c10d._world.pg_group_ranks
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-engine-rank")]


def test_an_announced_tensor_never_broadcast_fails_naming_the_engine_rank():
    from pytest_weightsync.transports.broadcast import BroadcastEngine, BroadcastError

    engine = BroadcastEngine(1, timeout=1)
    try:
        engine.update_weights_from_distributed(["a", "b"], [torch.float32] * 2, [(2,), (2,)])
        _send(engine, [torch.ones(2)])
        with pytest.raises(BroadcastError, match="engine rank 0: call 1: the broadcast of 2"):
            engine.finish()
    finally:
        engine.close()


def test_an_unaligned_flattened_announcement_is_refused_before_any_broadcast():
    from pytest_weightsync.transports.broadcast import BroadcastEngine

    engine = BroadcastEngine(1, timeout=1)
    try:
        with pytest.raises(BroadcastFormatError, match="'b'.*byte offset 3.*verl#7318"):
            engine.update_weights_from_distributed(["a", "b"], [torch.int8, "bfloat16"],
                                                   [(3,), (2,)], load_format="flattened_bucket")
        assert not engine.used  # nothing joined, nothing to clean up
    finally:
        engine.close()


def test_a_single_process_exporter_may_send_wire_buckets():
    """``export_weights`` results go through the same decoders: a flattened or serialized
    reference payload lands, an element-counted offset is refused naming bucket and entry."""
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation

    from ..harness import exporter as eh
    from ..harness import judge
    from ..harness.cases import ANCHORS

    class Encoded(ReferenceImplementation):
        name = "reference-encoded"
        encode = staticmethod(wire.flattened_bucket)

        def export_weights(self, trainer_states, **kwargs):
            return [self.encode(super().export_weights(trainer_states, **kwargs))]

    def serialized(bucket):
        return wire.serialized_update([bucket] * ANCHORS[1].receiver.tp, flattened=True)

    def in_elements(bucket):
        payload = wire.flattened_bucket(bucket)
        meta = payload["metadata"]
        meta[0] = meta[0]._replace(end_idx=meta[0].end_idx // 2)
        return payload

    for encode in (wire.flattened_bucket, serialized):
        Encoded.encode = staticmethod(encode)
        eh.export_and_check(Encoded(), ANCHORS[1], "compat", 1)
    Encoded.encode = staticmethod(in_elements)
    with pytest.raises(judge.ConformanceError, match="bucket 0 \\(flattened_bucket\\) entry 0"):
        eh.export_and_check(Encoded(), ANCHORS[1], "compat", 1)
