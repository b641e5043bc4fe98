"""Distributed exporters on every wire format, in real ranks: the reference passes on each, and
the encoder bugs public senders shipped are caught, located and named.

The reference distributed exporter sends its buckets as flattened buckets, serialized updates
(pairs or flattened, one entry per engine TP rank) and broadcasts (per tensor or one flattened
buffer per bucket), each on a colocated or a distributed case (engines of TP 2 and 4; plain
pairs run on the same cases in the conformance suite); each stream must land bit-exact through the suite's own check
(:func:`suites.harness.distributed.run_and_judge`). Each mutant is the reference with one
encoder bug planted: offsets counted in elements instead of bytes, mixed dtypes packed
without alignment (verl#7318), a serialized update with one entry where the engine has
four TP ranks, broadcasts in another order than announced. Ranks that send empty buckets (senders
that step through buckets collectively, slime#2134) are correct and pass.
"""

from __future__ import annotations

import pytest

from ..harness import distributed as dh
from ..harness import judge
from ..harness.cases import DIST_CASES
from pytest_weightsync.reference_impl.senders.distributed_export import (
    REFERENCE_TRANSPORTS,
    wire_transport,
)
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

pytestmark = pytest.mark.weightsync_property("mutation_detected")


def _case(fragment: str):
    return next(c for c in DIST_CASES if fragment in c.id)


#: Engine TP 2 fed by four colocated trainer ranks (two replicas), buckets of 480 bytes.
COLOCATED = _case("T.tp4ep1etp2pp1te-R.tp2ep1dp1ug-colocated")
#: Engine TP 4 (MoE-TP 2 x EP 2) fed by trainer rank 0, PP 2, buckets of 480 bytes.
DISTRIBUTED = _case("T.tp1ep2etp1pp2seq-R.tp2ep2dp1ug-distributed")


class OnTheWire(ReferenceImplementation):
    """The reference, its distributed exporter sending each call on the next transport of
    ``rotation`` (the reference's own encoders; ``weight_transfer``: its pairs as vLLM's
    calls)."""

    def __init__(self, rotation):
        super().__init__()
        self.rotation = tuple(rotation)
        self.calls = 0
        self.name = "reference-" + "-".join(self.rotation)

    def export_weights_distributed(self, model_state, **kwargs):
        import torch.distributed as dist

        from pytest_weightsync.transports import weight_transfer as wt

        transport = self.rotation[self.calls % len(self.rotation)]
        self.calls += 1
        self.transport = "tensors" if transport == "weight_transfer" else transport
        result = super().export_weights_distributed(model_state, **kwargs)
        if transport != "weight_transfer" or result is None:
            return result
        tp = kwargs["receiver"].tp
        if kwargs["delivery"] == "colocated":
            return wt.transfer_stream(result, backend="ipc", engine_ranks=[dist.get_rank() % tp])
        return {r: wt.transfer_stream(s, backend="ipc", engine_ranks=[r])
                for r, s in result.items()}


#: Each wire transport (``tensors`` runs on these cases in the conformance suite) on the
#: delivery where it is sent, rotating over the three updates of one run per delivery (each
#: update judged): colocated ranks flatten, serialize or call vLLM's protocol for their own
#: engine rank; the distributed sender serializes flattened buckets for every engine rank, or
#: broadcasts (per tensor, then one flattened buffer per bucket). A broadcast reaches every
#: engine rank with the same tensors: no per-rank direct payload there.
TRANSPORT_CASES = [
    pytest.param(COLOCATED, ("direct", "compat"),
                 ("flattened_bucket", "serialized", "weight_transfer"), id="colocated"),
    pytest.param(DISTRIBUTED, ("compat", "hf_fused"),
                 ("serialized_flattened", "broadcast", "broadcast_flattened"), id="distributed"),
]


def test_every_reference_transport_is_run():
    ran = {t for p in TRANSPORT_CASES for t in p.values[2]}
    assert ran >= set(REFERENCE_TRANSPORTS) - {"tensors"}, ran


@pytest.mark.parametrize("wire_case, formats, rotation", TRANSPORT_CASES)
def test_the_reference_lands_bit_exact_on_every_transport(rank_pool, wire_case, formats,
                                                          rotation):
    dh.require_megatron()
    result = dh.run_and_judge(rank_pool, OnTheWire(rotation), wire_case, formats)
    assert len(result.checked) == len(rotation)
    assert result.transports == {wire_transport(t)[0].name for t in rotation}


class _Encoder(ReferenceImplementation):
    """The reference distributed exporter, its streams re-encoded by :meth:`encode`."""

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, engine=None):
        import torch.distributed as dist

        result = super().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
        if result is None:
            return None
        rank = dist.get_rank()
        if delivery == "colocated":
            return self.encode(result, rank % receiver.tp, receiver.tp, rank)
        return {r: self.encode(s, r, receiver.tp, rank) for r, s in result.items()}


def _dense(bucket, *, in_elements: bool):
    """A flattened bucket of ``bucket`` packed densely in order (no alignment); with
    ``in_elements`` every offset and size counted in elements instead of bytes."""
    import torch

    from pytest_weightsync import wire

    pieces, metadata, offset = [], [], 0
    for name, tensor in bucket:
        data = wire.tensor_bytes(tensor)
        size = tensor.numel() if in_elements else data.numel()
        metadata.append(wire.FlattenedEntry(name, tuple(tensor.shape), tensor.dtype, offset,
                                            offset + size, size))
        pieces.append(data)
        offset += size
    return {"flattened_tensor": torch.cat(pieces), "metadata": metadata}


class OffsetsInElements(_Encoder):
    name = "mutant-flattened-offsets-in-elements"

    def encode(self, stream, engine_rank, engine_tp, rank):
        return [_dense(bucket, in_elements=True) for bucket in stream]


class MixedDtypesUnaligned(_Encoder):
    """Puts an odd-sized int8 marker before each bucket's tensors (a version stamp), packing
    densely: every later offset is odd."""

    name = "mutant-flattened-unaligned"

    def encode(self, stream, engine_rank, engine_tp, rank):
        import torch

        return [_dense([("weight_version", torch.ones(3, dtype=torch.int8)), *bucket],
                       in_elements=False) for bucket in stream]


class OneSerializedEntry(_Encoder):
    """Serializes each bucket once, as if the engine had one TP rank."""

    name = "mutant-serialized-one-entry"

    def encode(self, stream, engine_rank, engine_tp, rank):
        from pytest_weightsync import wire

        return [wire.serialized_update([bucket]) for bucket in stream]


class PadsWithEmptyBuckets(_Encoder):
    """Sends the same number of flattened buckets on every rank, as senders that step through
    buckets in a collective do: the ranks with fewer send empty ones (and trainer rank 1 one
    more). Correct: an empty bucket is a bucket with nothing in it, not an error."""

    name = "reference-padded-with-empty-buckets"

    def encode(self, stream, engine_rank, engine_tp, rank):
        from pytest_weightsync import wire

        padded = [*stream, *([[]] * (3 - len(stream) % 3)), *([[]] if rank == 1 else [])]
        return [wire.flattened_bucket(bucket) for bucket in padded]


class BroadcastsOutOfOrder(ReferenceImplementation):
    """Announces each bucket's names in order but broadcasts its tensors last to first (two
    same-shaped tensors then swap places)."""

    name = "mutant-broadcast-order"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, engine=None):
        import torch.distributed as dist

        from pytest_weightsync.reference_impl.senders import distributed_export as de

        if dist.get_rank() != 0:
            de.gather_full(spec, model_state)
            return None
        full = de.gather_full(spec, model_state)
        stream = de.engine_streams(full, format=format, spec=spec, receiver=receiver,
                                   delivery=delivery, bucket_bytes=bucket_bytes)[0]
        for bucket in stream:
            engine.update_weights_from_distributed([n for n, _ in bucket],
                                                   [t.dtype for _, t in bucket],
                                                   [tuple(t.shape) for _, t in bucket])
            for _, tensor in reversed(bucket):
                dist.broadcast(tensor.contiguous(), src=0, group=engine.group)
        return None


def _fails(rank_pool, impl, dcase, formats=("compat",)) -> str:
    dh.require_megatron()
    with pytest.raises(judge.ConformanceError) as info:
        dh.run_and_judge(rank_pool, impl, dcase, formats)
    return str(info.value)


def test_offsets_counted_in_elements_are_killed_and_located(rank_pool):
    message = _fails(rank_pool, OffsetsInElements(), DISTRIBUTED)
    assert "bucket 0 (flattened_bucket) entry 0" in message, message
    assert "counted in elements, not bytes" in message, message


def test_mixed_dtypes_packed_without_alignment_are_killed_and_named(rank_pool):
    message = _fails(rank_pool, MixedDtypesUnaligned(), COLOCATED)
    assert "bucket 0 (flattened_bucket) entry 1" in message, message
    assert "verl#7318" in message and "byte offset 3" in message, message


def test_a_serialized_update_without_an_entry_per_engine_rank_is_killed(rank_pool):
    message = _fails(rank_pool, OneSerializedEntry(), DISTRIBUTED)
    tp = DISTRIBUTED.receiver.tp
    assert "holds 1 entries" in message and f"one per engine TP rank ({tp})" in message, message


def test_broadcasts_out_of_announced_order_are_killed_and_located(rank_pool):
    message = _fails(rank_pool, BroadcastsOutOfOrder(), DISTRIBUTED)
    first = message.partition("\n")[0]
    assert first.endswith("-> engine rank 0, sent as broadcast:"), message
    assert "elements differ bitwise" in message and "first at layer=0" in message, message


def test_streams_with_empty_buckets_on_some_ranks_land(rank_pool):
    dh.require_megatron()
    dh.run_and_judge(rank_pool, PadsWithEmptyBuckets(), COLOCATED, ("direct",))
