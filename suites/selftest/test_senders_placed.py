"""Senders placed as real jobs place them: every pipeline stage's source rank broadcasting its
own stage over its own group, and a colocated replica's gather source sending the serialized
update of the whole replica while its other ranks send nothing (``docs/transports.md``,
"Where senders send from").

slime's distributed path announces and broadcasts from the source rank of each PP stage (TP
rank 0 of DP rank 0) over that stage's own weights-update group; the harness gives each of
those ranks an engine channel of its own and joins what the stages sent each engine rank.
slime's colocated path gathers every rank's tensors onto the replica's gather source, which
sends one serialized update with an entry per engine TP rank; the other ranks return nothing,
which the harness reads as "nothing from this rank" - what the engine rank gets is what every
trainer rank of its replica sent it, so a rank that returns nothing where nobody sends for it
leaves its engine rank never written, and the value check says so.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.impl import ReferenceImplementation

from ..harness import distributed as dh
from ..harness import judge
from ..harness import model_distributed as md
from ..harness.cases import DIST_CASES

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: Engine TP 4 (MoE-TP 2 x EP 2) fed from PP 2 (stage sources: trainer ranks 0 and 2).
PP2_DISTRIBUTED = next(c for c in DIST_CASES if "T.tp1ep2etp1pp2seq-R.tp2ep2dp1ug-distributed"
                       in c.id)
#: Engine TP 2 fed by four colocated trainer ranks (two replicas: ranks 0-1 and 2-3).
COLOCATED = next(c for c in DIST_CASES if "T.tp4ep1etp2pp1te-R.tp2ep1dp1ug-colocated" in c.id)
#: A whole model (3 layers on uneven stages) on engine TP 2, colocated.
MODEL_COLOCATED = next(c for c in md.MODEL_DIST_CASES if "-first2-colocated" in c.id)


class StageSourcesBroadcast(ReferenceImplementation):
    """Every rank gathers; each pipeline stage's source rank (the one given an ``engine``)
    announces and broadcasts its own stage's layers over its own group, as slime does."""

    name = "reference-stage-sources-broadcast"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, engine=None):
        from megatron.core import parallel_state as ps

        from pytest_weightsync.reference_impl.senders import distributed_export as de
        from pytest_weightsync.reference_impl.senders import formats
        from pytest_weightsync.reference_impl.senders.buckets import split_buckets
        from pytest_weightsync.transports import broadcast

        full = de.gather_full(spec, model_state)  # collective: every rank
        if engine is None:
            return None
        per_stage = spec.num_layers // trainer.pp
        first = ps.get_pipeline_model_parallel_rank() * per_stage
        layers = range(first, first + per_stage)
        stream = split_buckets(formats.export(format, spec, receiver, 0, full, layers),
                               bucket_bytes)
        broadcast.send(engine, stream, flattened=False)
        return None


class GatherSourceSerializes(ReferenceImplementation):
    """Each colocated rank builds its own engine rank's stream; the replica's first rank (its
    gather source) sends them all as serialized updates, one entry per engine TP rank; the
    other ranks return ``None`` (slime's colocated path after ``gather_object``)."""

    name = "reference-gather-source-serializes"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, engine=None):
        import torch.distributed as dist

        from pytest_weightsync import wire

        own = super().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, own)
        rank = dist.get_rank()
        if rank % receiver.tp:
            return None  # not the gather source: nothing from this rank
        replica = everyone[rank:rank + receiver.tp]
        count = max(len(s) for s in replica)
        return [wire.serialized_update([s[b] if b < len(s) else [] for s in replica])
                for b in range(count)]


class RankSendsNothing(ReferenceImplementation):
    """The reference whole-model exporter, colocated, with trainer rank 1 returning nothing
    and no gather source sending for its engine rank."""

    name = "mutant-colocated-rank-sends-nothing"

    def export_weights_distributed(self, model_state, **kwargs):
        import torch.distributed as dist

        result = super().export_weights_distributed(model_state, **kwargs)
        return None if dist.get_rank() == 1 else result


def test_each_stage_source_broadcasting_its_own_stage_lands(rank_pool):
    dh.require_megatron()
    result = dh.run_and_judge(rank_pool, StageSourcesBroadcast(), PP2_DISTRIBUTED, ["compat"])
    assert result.transports == {"broadcast"}


def test_a_gather_source_serializing_for_its_replica_lands(rank_pool):
    """Ranks 1 and 3 return ``None``; ranks 0 and 2 each send every engine rank of their
    replica its entry."""
    dh.require_megatron()
    result = dh.run_and_judge(rank_pool, GatherSourceSerializes(), COLOCATED, ["direct"])
    assert result.transports == {"serialized"}


def test_a_rank_returning_nothing_that_nobody_covers_is_never_written(rank_pool):
    """Whole model: trainer rank 1 returns ``None`` and no gather source sends for engine rank
    1 - coverage reports its parameters never written, naming the rank."""
    dh.require_megatron()
    result = md.run(rank_pool, RankSendsNothing(), MODEL_COLOCATED, ["compat"])
    with pytest.raises(judge.ConformanceError) as info:
        md.judge_update(result, 0)
    message = str(info.value)
    assert "trainer rank 1 (nothing from this rank) -> colocated engine replica 0 rank 1" \
        in message, message[:2000]
    assert "never written" in message, message[:2000]
