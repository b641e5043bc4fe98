"""Driving an exporter (``export_weights``) and judging its payloads.

The exporter gets every trainer rank's Megatron-Core expert shards of the case; after EVERY
call the shards are checked bit-identical - before any receiver value is judged, so the
failure names the call that changed them - and its payload for each receiver rank (pairs, or
buckets on a wire format: ``pytest_weightsync.wire``, or vLLM's weight-transfer calls:
``pytest_weightsync.transports.weight_transfer``, decoded by the harness) is loaded by the
reference receiver (``suites.harness.reference``) and judged bit for bit.
"""

from __future__ import annotations

from pytest_weightsync.protocols import as_stream

from . import calls, judge, reference


def export_and_check(exporter, case, fmt, version, ranks=None):
    """Export ``version`` for each receiver rank in ``ranks`` (default all; one call per rank),
    checking the trainer shards after every call, then judge each rank's stream."""
    from . import inputs

    states = inputs.trainer_states(case, version)
    for rank, stream in exported_streams(exporter, case, fmt, states, ranks):
        reference.judge_stream(case, rank, stream, fmt, version,
                               f"{fmt} payload of {exporter.name}.export_weights for receiver "
                               f"rank {rank}")


def exported_streams(exporter, case, fmt, states, ranks=None, shards_before=None):
    """``(rank, stream)`` of one ``export_weights`` call per receiver rank in ``ranks``
    (default all), for the expert-only and the whole-model suites alike: after every call the
    trainer ``states`` must still hold ``shards_before`` (default: what they hold now), and the
    result - pairs, buckets, or buckets on a wire transport (``docs/transports.md``) - is
    decoded as that receiver rank reads it, the one decoding step every suite shares."""
    from pytest_weightsync import distributed

    if shards_before is None:
        shards_before = [distributed.snapshot(state) for state in states]
    source = f"{exporter.name}.export_weights"
    for rank in (range(case.receiver.tp) if ranks is None else ranks):
        result = calls.call(exporter, "export_weights", states, format=fmt, spec=case.spec,
                            trainer=case.trainer, receiver=case.receiver, rank=rank)
        for trainer_rank, (shards, state) in enumerate(zip(shards_before, states)):
            where = distributed.first_modification(shards, state)
            if where is not None:
                raise judge.ConformanceError(f"export call for receiver rank {rank} ({fmt}) "
                                             f"modified trainer rank {trainer_rank}'s shard {where}")
        try:  # wire buckets (flattened, serialized) and vLLM's weight-transfer calls decoded
            #     as that receiver rank reads them; the other ranks' entries of a serialized
            #     update are read too and dropped (each descriptor fetched once, as an engine does)
            stream = as_stream(distributed.decoded_stream(
                result, engine_rank=rank, engine_tp=case.receiver.tp, source=source,
                transports_met=set()), source=source)
        except (TypeError, distributed.DistributedExportError) as error:
            raise judge.ConformanceError(f"export call for receiver rank {rank} ({fmt}): "
                                         f"{error}") from None
        yield rank, stream
