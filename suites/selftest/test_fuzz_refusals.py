"""What the fuzz found accepted, or crashing, is refused before anything is written, by the
project's own errors, and no process aborts.

- FP8 block scales that are NaN, infinite, zero or negative: every element of the block is
  read as ``q * scale_inv``, so the receiver refuses the entry (:class:`BlockScaleError`,
  naming the entry and its first bad block) and writes nothing of the bucket.
- A flattened bucket whose metadata shape is no shape (``(2.9, 8)``, a bool, a str, a
  negative size ...): SGLang's ``reshape`` raises, where ``int()`` would quietly read
  ``(2, 8)``; a flattened bucket over freed or shrunk storage: a use after free, refused
  naming the bucket instead of a bare torch ``RuntimeError``.
- A serialized payload naming ``os.system`` (or ``eval``, ``getattr`` ...): refused by name
  before it is called, as SGLang's ``SafeUnpickler`` refuses it; the harness admits no global
  SGLang does not (its own metadata class apart).
- An EPLB receiver handed the open update of another placement (or rank): refused, naming
  the layer whose slots moved.
- A broadcast that disagrees with its announcement (longer: gloo aborts the process; float32
  where bfloat16 was announced; shorter: the buffer keeps its old bytes; non-contiguous;
  unannounced): refused in the sender before the collective runs, naming the announced and
  the sent dtype, shape and bytes; in real ranks, every rank goes on to the next update.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from . import tensor_kind_probes as kp
from .sharer import drop_unfetched_shares
from ..harness import cases, inputs
from pytest_weightsync import compare, wire
from pytest_weightsync.transports import serialized
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.engine.engine_receivers import (
    PlacementChangedError,
    RedundantExpertReceiver,
)
from pytest_weightsync.reference_impl.engine.fp8_receiver import BlockScaleError, Fp8BlockReceiver
from pytest_weightsync.reference_impl.errors import PayloadError, WeightSyncError
from pytest_weightsync.reference_impl.model import fp8
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology

pytestmark = pytest.mark.weightsync_property("bad_payload_refused")


# --- FP8 block scales ---------------------------------------------------------------------------

#: 4 x 4 blocks, hidden 10 (a partial last block column), MoE-TP 2 x EP 2.
FP8_CASE = cases.FP8_CASES[0]
BAD_SCALES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "zero": 0.0,
              "negative-zero": -0.0, "negative": -0.25}


def _fp8_receiver(rank):
    rec = Fp8BlockReceiver(FP8_CASE.spec, FP8_CASE.receiver, rank)
    # the state after a first update, so that a write of anything would show
    for bucket in inputs.fp8_stream("compat", FP8_CASE, rank, 1, "sender", bucket=None):
        rec.load(bucket)
    return rec


def _fp8_bucket(fmt, rank):
    return inputs.fp8_stream(fmt, FP8_CASE, rank, 2, "sender", bucket=None)[0]


def _scale_entry(fmt, rank, name):
    """A fresh receiver of ``rank``, its ``fmt`` bucket, the index of the block scale ``name``
    in it and a copy of that scale: each test spoils the copy and puts it back."""
    rec = _fp8_receiver(rank)
    bucket = _fp8_bucket(fmt, rank)
    index = next(i for i, (n, _) in enumerate(bucket) if n == name)
    return rec, bucket, index, bucket[index][1].clone()


def _refused(rec, bucket, load_format, error=PayloadError):
    before = compare.snapshot(rec.params)
    with pytest.raises(error) as info:
        rec.load(bucket, load_format=load_format)
    compare.assert_unchanged(before, rec.params, rank=rec.rank)
    return str(info.value)


@pytest.mark.parametrize("bad", sorted(BAD_SCALES))
def test_a_bad_block_scale_of_a_per_expert_entry_is_refused_naming_its_block(bad):
    rank = 0  # experts 0..1, MoE-TP rows 0..7
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    rec, bucket, index, scale = _scale_entry("compat", rank, name)
    assert scale.shape == (4, 3) and bool((scale > 0).all())
    scale[1, 2] = BAD_SCALES[bad]
    bucket[index] = (name, scale)
    message = _refused(rec, bucket, None, BlockScaleError)
    assert f"payload entry {index} {name!r}: block scale " in message, message
    assert "at block index (1, 2): rows 4..7, cols 8..11 of its weight" in message, message
    assert "must be finite and positive" in message and len(message) < 600, message
    assert ("NaN" if bad == "nan" else repr(BAD_SCALES[bad])) in message, message


def test_every_bad_block_is_counted_and_the_first_named():
    rank = 2  # experts 2..3
    name = "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"  # another rank's expert
    rec, bucket, index, scale = _scale_entry("compat", rank, name)
    scale[2, 0], scale[0, 3] = -1.0, float("nan")
    bucket[index] = (name, scale)
    message = _refused(rec, bucket, None, BlockScaleError)
    assert "NaN at block index (0, 3)" in message and "(2 of 12 block scales bad)" in message, \
        message


def test_a_bad_block_scale_of_a_direct_entry_is_located():
    rank = 1  # experts 0..1, MoE-TP rows 8..15
    name = "model.layers.0.mlp.experts.w13_weight_scale_inv"
    rec, bucket, index, scale = _scale_entry("direct", rank, name)
    assert scale.shape == (2, 4, 3)
    scale[1, 3, 0] = float("inf")
    bucket[index] = (name, scale)
    message = _refused(rec, bucket, "direct", BlockScaleError)
    assert f"payload entry {index} {name!r}: block scale inf (infinite) at block index " \
           f"(1, 3, 0)" in message, message
    assert "(layer=0 expert=1 projection=up block=(3, 0) rows 12..15 cols 0..3" in message, \
        message


def test_extreme_finite_positive_scales_load():
    """The smallest scale a quantizer makes (amax clamped at AMAX_FLOOR) and the largest
    finite float32 are scales, and load."""
    rank = 0
    rec = _fp8_receiver(rank)
    bucket = _fp8_bucket("compat", rank)
    for i, (name, tensor) in enumerate(bucket):
        if name.endswith(fp8.SCALE_SUFFIX):
            scale = tensor.clone()
            scale[0, 0] = fp8.AMAX_FLOOR / fp8.FP8_MAX
            scale[-1, -1] = torch.finfo(torch.float32).max
            bucket[i] = (name, scale)
    rec.load(bucket)
    held = rec.params["model.layers.0.mlp.experts.w13_weight_scale_inv"]
    assert float(held[0, 0, 0]) == pytest.approx(fp8.AMAX_FLOOR / fp8.FP8_MAX)


def test_a_refused_scale_counts_as_a_refused_bucket_of_the_update():
    rank = 0
    rec = _fp8_receiver(rank)
    good = _fp8_bucket("compat", rank)
    bad = [(n, t.clone().fill_(0.0) if n.endswith(fp8.SCALE_SUFFIX) else t) for n, t in good]
    rec.begin_update()
    with pytest.raises(BlockScaleError, match="payload entry 1 of bucket 0 "):
        rec.load(bad)
    rec.load(good)
    rec.end_update()
    assert isinstance(BlockScaleError("x"), WeightSyncError)


# --- flattened buckets --------------------------------------------------------------------------

def _flattened(shape):
    payload = wire.flattened_bucket([("a", torch.arange(16, dtype=torch.int8).reshape(2, 8))])
    payload["metadata"][0] = payload["metadata"][0]._replace(shape=shape)
    return payload


#: Shapes SGLang's ``reconstruct_tensors`` raises on (the byte count fits 16 int8 elements
#: wherever the entries are sizes), each with the words that name it.
BAD_SHAPES = {
    "float": ((2.9, 8), "holds the float 2.9"),
    "integral-float": ((2.0, 8), "holds the float 2.0"),
    "bool-dim": ((True, 16), "holds the bool True"),
    "bool-shape": (True, "is a bool"),
    "str-dim": ((2, "8"), "holds a str '8'"),
    "str": ("28", "is a str"),
    "set": ({2, 8}, "is a set"),
    "dict": ({2: 0, 8: 0}, "is a dict"),
    "none": (None, "is a NoneType"),
    "float-tail": ((2, 8, 1.0), "holds the float 1.0"),
    "wrong-product": ((3, 8), "needs 24"),
    "too-many-dims": ((2, 8, 2), "needs 32"),
}


def _sglang_reconstruct(payload):
    tensor_bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
    return tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=payload["flattened_tensor"],
        metadata=payload["metadata"]).reconstruct_tensors()


@pytest.mark.parametrize("kind", sorted(BAD_SHAPES))
def test_a_metadata_shape_that_is_no_shape_is_refused_where_sglang_raises(kind):
    shape, words = BAD_SHAPES[kind]
    payload = _flattened(shape)
    with pytest.raises(wire.WireFormatError) as info:
        wire.decode_bucket(payload, engine_rank=0, engine_tp=1, where="bucket 3 (flattened_bucket)")
    message = str(info.value)
    assert message.startswith("bucket 3 (flattened_bucket) entry 0 'a': "), message
    assert words in message, message
    with pytest.raises((TypeError, RuntimeError)):
        _sglang_reconstruct(payload)


def test_a_negative_size_is_refused_though_sglang_would_infer_it():
    with pytest.raises(wire.WireFormatError, match="entry 0 'a': negative size -1 in shape"):
        wire.decode_flattened(_flattened((-1, 16)))


@pytest.mark.parametrize("kind", ["float", "bool-dim", "str", "float-tail"])
def test_a_broadcast_announcement_of_no_shape_is_refused(kind):
    """As in flattened metadata; SGLang's receive bucket raises on each but the bool, which
    ``torch.Size`` reads as 1 (no sender's ``tensor.shape`` holds one)."""
    from pytest_weightsync.transports.broadcast import BroadcastEngine

    shape, words = BAD_SHAPES[kind]
    engine = BroadcastEngine(1, timeout=1)
    try:
        with pytest.raises(wire.WireFormatError, match=f"^'a': .*{words}"):
            engine.update_weights_from_distributed(["a"], [torch.int8], [shape],
                                                   load_format="flattened_bucket")
        assert not engine.used  # refused before any engine rank joined
    finally:
        engine.close()
    tensor_bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
    if kind != "bool-dim":
        with pytest.raises(TypeError):
            tensor_bucket.FlattenedTensorBucket.empty(["a"], [torch.int8], [shape], "cpu")


@pytest.mark.parametrize("shape", ["list", "size", "int-tensor-dim", "bare-int", "numpy"])
def test_shapes_sglang_reads_are_read_the_same(shape):
    import numpy as np

    shape = {"list": [2, 8], "size": torch.Size([2, 8]), "int-tensor-dim": (torch.tensor(2), 8),
             "bare-int": 16, "numpy": (np.int64(2), np.int64(8))}[shape]
    payload = _flattened(shape)
    ours, theirs = wire.decode_flattened(payload), _sglang_reconstruct(payload)
    assert ours[0][1].shape == theirs[0][1].shape and torch.equal(ours[0][1], theirs[0][1])


@pytest.mark.parametrize("damage, words", [
    (lambda flat: flat.untyped_storage().resize_(0), "its storage was freed"),
    (lambda flat: flat.untyped_storage().resize_(8), "its storage holds 8 bytes"),
], ids=["freed", "shrunk"])
def test_a_flattened_bucket_over_unreadable_storage_names_the_bucket(damage, words):
    payload = wire.flattened_bucket([("a", torch.ones(2, 2)), ("b", torch.ones(3))])
    damage(payload["flattened_tensor"])
    with pytest.raises(wire.WireFormatError) as info:
        wire.decode_bucket(payload, engine_rank=0, engine_tp=1, where="bucket 2 (flattened_bucket)")
    message = str(info.value)
    assert message.startswith("bucket 2 (flattened_bucket): flattened_tensor (28 bytes): "), message
    assert words in message, message


@pytest.mark.parametrize("damage", ["freed", "float-shape"])
def test_the_reference_loader_refuses_a_broken_flattened_bucket_before_writing(damage):
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation

    kwargs = dict(format="compat", spec=kp.SPEC, topology=kp.TOPOLOGY, rank=kp.RANK)
    impl, params = ReferenceImplementation(), kp.fresh_params()
    payload = wire.flattened_bucket(kp.bucket("compat", [0]))
    if damage == "freed":
        payload["flattened_tensor"].untyped_storage().resize_(0)
        words = "its storage was freed"
    else:
        meta = payload["metadata"]
        meta[1] = meta[1]._replace(shape=(meta[1].shape[0] + 0.5, *meta[1].shape[1:]))
        words = "entry 1 'model.layers.0.mlp.experts.0.up_proj.weight': shape"
    before = compare.snapshot(params)
    with pytest.raises(PayloadError, match=words):
        impl.load_weights(params, payload, **kwargs)
    compare.assert_unchanged(before, params)


# --- serialized payloads ------------------------------------------------------------------------

MARKER = "weightsync-pwned-marker"


class _Runs:
    """Pickles as a call of ``func(*args)``, as an attacker's payload does."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _gadgets(path):
    import subprocess

    return {
        "os.system": _Runs(os.system, f"touch {path}"),
        "subprocess.Popen": _Runs(subprocess.Popen, ["touch", str(path)]),
        "builtins.eval": _Runs(eval, f"open({str(path)!r}, 'w')"),
        "builtins.exec": _Runs(exec, f"open({str(path)!r}, 'w')"),
        "builtins.getattr": _Runs(getattr, str(path), "upper"),
        "torch.load": _Runs(torch.load, str(path)),
        "builtins.open": _Runs(open, str(path), "w"),
    }


@pytest.mark.parametrize("gadget", sorted(_gadgets("x")))
def test_a_payload_naming_a_code_global_is_refused_and_never_run(tmp_path, gadget):
    path = tmp_path / MARKER
    payload = [("w", torch.ones(2)), ("x", _gadgets(path)[gadget])]
    update = wire.TensorUpdate([pickle.dumps(payload)])
    with pytest.raises(wire.UnsafePayloadError) as info:
        wire.decode_serialized(update, engine_rank=0, engine_tp=1)
    message = str(info.value)
    assert message.startswith("serialized update, entry [0]: the payload names the global "), \
        message
    assert "refused before it was called" in message and len(message) < 400, message
    assert isinstance(info.value, wire.WireFormatError) and isinstance(info.value, ValueError)
    assert not path.exists(), f"{gadget} ran"


def test_a_refused_payload_reaches_no_exporter_stream():
    """In a distributed export the refusal is the harness's error naming the bucket."""
    from pytest_weightsync import distributed

    update = wire.TensorUpdate([pickle.dumps([("x", _Runs(os.system, "true"))])])
    with pytest.raises(distributed.DistributedExportError,
                       match=r"^src: bucket 0 \(serialized\), entry \[0\]: the payload names "
                             r"the global posix\.system"):
        distributed.decoded_stream([update], engine_rank=0, engine_tp=1, source="src",
                                   transports_met=set())


def test_a_gadget_inside_a_local_serialized_tensor_value_is_refused(tmp_path):
    lst = pytest.importorskip(
        "sglang.srt.model_executor.model_runner_components.weight_updater")
    path = tmp_path / MARKER
    evil = pickle.dumps(_Runs(os.system, f"touch {path}"))
    named = [("w", lst.LocalSerializedTensor(values=[evil]))]
    update = wire.TensorUpdate([wire.serialize(named)])
    with pytest.raises(wire.UnsafePayloadError,
                       match=r"entry \[0\] 'w' value \[0\]: the payload names the global "
                             r"posix\.system"):
        wire.decode_serialized(update, engine_rank=0, engine_tp=1)
    assert not path.exists()


def test_the_harness_admits_no_global_sglang_refuses():
    """Every global the harness admits is in SGLang 0.5.23's ``SafeUnpickler`` allow-list, but
    the harness's own metadata named tuple; every ``torch.<name>`` it admits beyond the list
    is a ``torch.dtype`` (never a callable)."""
    common = pytest.importorskip("sglang.srt.utils.common")
    theirs = common.SafeUnpickler.ALLOWED_GLOBALS
    extra = set(wire.SAFE_GLOBALS) - set(theirs)
    assert extra == {("pytest_weightsync.transports.flattened", "FlattenedEntry")}, extra
    dtypes = {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    assert all(serialized._safe_global("torch", n) for n in dtypes)
    assert not [n for n in dtypes if ("torch", n) not in theirs]
    for module, name in [("torch", "load"), ("torch", "_C"), ("torch", "onnx"),
                         ("builtins", "getattr"), ("os", "system"), ("functools", "partial")]:
        assert not serialized._safe_global(module, name), (module, name)


def test_payloads_pickled_every_way_a_sender_does_still_decode():
    """ForkingPickler (shared memory), plain pickle (a storage's bytes, read weights-only),
    protocol 2 (bytes through ``_codecs.encode``), base64 ``str``, parameters, flattened
    buckets with either metadata class."""
    bucket = [("a", torch.arange(6, dtype=torch.bfloat16)),
              ("p", torch.nn.Parameter(torch.ones(2)))]
    entries = [wire.serialize(bucket), wire.serialize(bucket, as_str=True), pickle.dumps(bucket),
               pickle.dumps(bucket, protocol=2)]
    try:
        for rank in range(len(entries)):
            got, _ = wire.decode_serialized(wire.TensorUpdate(entries), engine_rank=rank,
                                            engine_tp=len(entries))
            assert [n for n, _ in got] == ["a", "p"]
            assert all(torch.equal(g, t) for (_, g), (_, t) in zip(got, bucket))
        for meta_type in {wire.FlattenedEntry, wire.metadata_type()}:
            update = wire.serialized_update([bucket], flattened=True, meta_type=meta_type)
            got, load_format = wire.decode_serialized(update, engine_rank=0, engine_tp=1)
            assert load_format == "flattened_bucket" and torch.equal(got[0][1], bucket[0][1])
    finally:
        drop_unfetched_shares()


# --- an EPLB update resumed under another placement -------------------------------------------

#: Explicit placement, two copies of expert 2 on rank 0 (MoE-TP 2 x EP 2, up/gate).
EPLB_CASE = next(c for c in cases.ENGINE_CASES if c.receiver.placement is not None)


def _rebalanced(topo, layer, placement_row):
    import dataclasses

    rows = list(topo.placement)
    rows[layer] = placement_row
    return dataclasses.replace(topo, placement=tuple(rows))


def _eplb_bucket(rank, layers):
    return inputs.payload("compat", EPLB_CASE, rank, layers=layers,
                          full=inputs.gathered_weights(EPLB_CASE, 1))


@pytest.mark.parametrize("other, words", [
    ("rebalanced", "the update was begun under another placement (1 layer(s) differ, first "
                   "layer 1: this rank's physical slots 0..1 held logical experts [1, 0] then, "
                   "[0, 1] now); the 1 bucket(s) loaded so far went into the old placement's "
                   "slots"),
    ("elsewhere", "the update was begun under another placement (1 layer(s) differ, first "
                  "layer 1: this rank's slots are the same, other ranks' moved)"),
    ("rank", "EPLB receiver rank 1: the update was begun by receiver rank 0"),
    ("plain", "got a state that records no placement (UpdateState)"),
])
def test_an_eplb_update_is_not_resumed_under_another_placement(other, words):
    spec, topo, rank = EPLB_CASE.spec, EPLB_CASE.receiver, 0
    opened = RedundantExpertReceiver(spec, topo, rank)
    opened.begin_update()
    opened.load(_eplb_bucket(rank, [0]))
    before = compare.snapshot(opened.params)
    state = opened.update_state
    if other == "rebalanced":  # rank 0's slots of layer 1 swap their experts
        resumer = RedundantExpertReceiver(spec, _rebalanced(topo, 1, (0, 1, 2, 0)), rank,
                                          params=opened.params)
    elif other == "elsewhere":  # only rank 1's slots of layer 1 move
        resumer = RedundantExpertReceiver(spec, _rebalanced(topo, 1, (1, 0, 0, 2)), rank,
                                          params=opened.params)
    elif other == "rank":
        resumer = RedundantExpertReceiver(spec, topo, 1)
    else:
        resumer = RedundantExpertReceiver(spec, topo, rank, params=opened.params)
        state = rx.UpdateState(seen=dict(state.seen), offered=state.offered)
    with pytest.raises(PlacementChangedError) as info:
        resumer.resume_update(state)
    message = str(info.value)
    assert words in message, message
    assert isinstance(info.value, rx.IncompleteUpdateError) and len(message) < 600
    assert not resumer.in_update
    compare.assert_unchanged(before, opened.params, rank=rank)


def test_an_eplb_update_resumed_under_its_own_placement_completes():
    spec, topo, rank = EPLB_CASE.spec, EPLB_CASE.receiver, 1
    opened = RedundantExpertReceiver(spec, topo, rank)
    opened.begin_update()
    opened.load(_eplb_bucket(rank, [0]))
    resumer = RedundantExpertReceiver(spec, topo, rank, params=opened.params)
    resumer.resume_update(opened.update_state)
    resumer.load(_eplb_bucket(rank, [1]))
    resumer.end_update()


# --- broadcasts that disagree with their announcement -----------------------------------------

#: Each mismatch: what the sender does with the announced bucket of ``w`` (bf16 4 x 8) and
#: ``b`` (float32 3), and the words of the refusal.
MISMATCHES = {
    "longer": "announced torch.bfloat16 (4, 8), 64 bytes, sent torch.bfloat16 (5, 8), 80 "
              "bytes: longer than announced",
    "fp32-for-bf16": "announced torch.bfloat16 (4, 8), 64 bytes, sent torch.float32 (4, 8), "
                     "128 bytes: longer than announced",
    "shorter": "announced torch.bfloat16 (4, 8), 64 bytes, sent torch.bfloat16 (3, 8), 48 "
               "bytes: shorter than announced: the engine ranks' buffers would keep their old "
               "bytes after byte 48",
    "fp16-for-bf16": "sent torch.float16 (4, 8), 64 bytes: torch.float16 where torch.bfloat16 "
                     "was announced",
    "non-contiguous": "sent a non-contiguous torch.bfloat16 (4, 8), 64 bytes (strides (1, 4))",
    "unannounced": "a broadcast (torch.float32 (2,), 8 bytes) after call 1, with no announced "
                   "tensor left",
    "flattened-longer": "(the flattened buffer of 2 announced tensor(s), first 'w'): announced "
                        "torch.uint8 (76,), 76 bytes, sent torch.uint8 (77,), 77 bytes: longer",
}


def _bucket():
    return [("w", torch.arange(1, 33, dtype=torch.bfloat16).reshape(4, 8)),
            ("b", torch.arange(1, 4, dtype=torch.float32))]


def _send(engine, kind: str) -> None:
    """Announce :func:`_bucket` and broadcast it, mismatched as ``kind`` says (``ok``: as
    announced), with ``torch.distributed.broadcast`` as exporters call it."""
    import torch.distributed as dist

    bucket = _bucket()
    flattened = kind.startswith("flattened")  # flattened-ok: as announced
    engine.update_weights_from_distributed([n for n, _ in bucket], [t.dtype for _, t in bucket],
                                           [tuple(t.shape) for _, t in bucket],
                                           load_format="flattened_bucket" if flattened else None)
    w, b = (t for _, t in bucket)
    if flattened:
        flat = torch.cat([wire.tensor_bytes(w), wire.tensor_bytes(b)])
        extra = flat[:1] if kind == "flattened-longer" else flat[:0]
        dist.broadcast(torch.cat([flat, extra]), src=0, group=engine.group)
        return
    sent = {"longer": lambda: torch.cat([w, w[:1]]), "fp32-for-bf16": w.float,
            "shorter": lambda: w[:3].contiguous(), "fp16-for-bf16": w.half,
            "non-contiguous": lambda: w.T.contiguous().T}.get(kind, lambda: w)()
    dist.broadcast(sent, src=0, group=engine.group)
    dist.broadcast(b, src=0, group=engine.group)
    if kind == "unannounced":
        dist.broadcast(torch.ones(2), src=0, group=engine.group)


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_a_mismatched_broadcast_is_refused_in_the_sender_and_nothing_reaches_the_engine(kind):
    import threading

    from pytest_weightsync.transports.broadcast import BroadcastEngine, BroadcastMismatchError

    engine = BroadcastEngine(2, timeout=10)
    try:
        _send(engine, kind)
        _send(engine, "ok")  # after a refusal the exporter's next call sends nothing either
        ranks = list(engine._ranks)
        with pytest.raises(BroadcastMismatchError) as info:
            engine.finish()
        received = [thread.stream for thread in ranks]  # joined by finish()
    finally:
        engine.close()
    message = str(info.value)
    assert message.startswith("broadcast refused in the sender: "), message
    assert MISMATCHES[kind] in message and "refused before the collective ran" in message, message
    assert isinstance(info.value, AssertionError) and len(message) < 700
    for stream in received:
        assert len(stream) == 1  # the first call only: nothing is announced after a refusal
        if kind == "unannounced":  # the announced bucket landed whole before the extra one
            assert all(torch.equal(got, want) for (_, got), (_, want) in zip(stream[0], _bucket()))
            continue
        for _, tensor in stream[0]:  # zeros of the announced size, never a byte sent
            assert not bool(wire.tensor_bytes(tensor).any())
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-engine-rank")]


def test_a_matching_broadcast_still_lands():
    from pytest_weightsync.transports.broadcast import BroadcastEngine

    engine = BroadcastEngine(2, timeout=10)
    try:
        _send(engine, "ok")
        _send(engine, "flattened-ok")
        streams = engine.finish()
    finally:
        engine.close()
    for stream in streams.values():
        assert len(stream) == 2
        for bucket in stream:
            assert all(torch.equal(got, want) for (_, got), (_, want) in zip(bucket, _bucket()))


class _Mismatched:
    """A distributed exporter that announces :func:`_bucket` to the engine and broadcasts it
    mismatched as ``kind`` says; other ranks send nothing."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"mutant-broadcast-{kind}"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, engine=None):
        if engine is not None:
            _send(engine, self.kind)
        return None


def _export_each_in_rank(kinds):
    """Rank body: one export call per kind (distributed delivery, engine TP 2), each followed
    by a barrier of every trainer rank, as the next update's gather would be."""
    import torch.distributed as dist

    from pytest_weightsync import distributed

    rank, out = dist.get_rank(), []
    for update, kind in enumerate(kinds, start=1):
        try:
            result = distributed.call_exporter(
                _Mismatched(kind), {"w": torch.zeros(2)}, config=None, format="compat",
                spec=None, trainer=None, receiver=ReceiverTopology(tp=2),
                delivery="distributed", bucket_bytes=None, rank=rank, update=update)
            out.append({r: [[(n, t.dtype, tuple(t.shape)) for n, t in bucket]
                            for bucket in stream] for r, stream in result.streams.items()})
        except distributed.DistributedExportError as error:
            out.append(str(error))
        dist.barrier()
    return os.getpid(), out


def test_mismatched_broadcasts_in_real_ranks_abort_nothing(rank_pool):
    """The gloo abort the fuzz found killed trainer rank 0: here every mismatch is refused in
    the sender, named with the call, and every rank reaches the next update alive."""
    kinds = [*sorted(MISMATCHES), "ok"]
    results = rank_pool.run(_export_each_in_rank, 2, kinds, timeout=120)
    (pid0, sender), (pid1, other) = results
    assert pid0 != pid1
    for update, kind in enumerate(kinds[:-1], start=1):
        message = sender[update - 1]
        assert isinstance(message, str), (kind, message)
        assert message.startswith(f"mutant-broadcast-{kind}: export call for update {update} "
                                  f"(compat, distributed delivery) in trainer rank 0: "
                                  f"broadcast refused in the sender: "), message
        assert MISMATCHES[kind] in message, message
    landed = {0: [[("w", torch.bfloat16, (4, 8)), ("b", torch.float32, (3,))]]}
    assert sender[-1] == {**landed, 1: landed[0]}
    assert other == [{}] * len(kinds)
