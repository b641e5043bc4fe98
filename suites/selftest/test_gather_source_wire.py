"""A colocated gather source's serialized updates decode in every engine rank's own process.

slime's and verl's colocated refit: the ranks of one engine replica hand their tensors to a
gather source, which serializes ONE update per bucket for every engine TP rank of the replica
(SGLang's ``MultiprocessingSerializer``; CPU tensors shared by file descriptor, or by
shared-memory file name under torch's ``file_system`` strategy) and sends it to the engine,
whose TP worker ``k`` reads entry ``k`` - in another process than the source. Here the source's
serialized calls go to every rank of its group (``broadcast_object_list``) and each rank
returns them, so engine rank ``k``'s entry is decoded in trainer rank ``k``, fetching the
descriptors from the source's process-wide ``resource_sharer``. That must work over every
update, whichever sharing strategy, with entries as plain pairs or as ``LocalSerializedTensor``
values per engine rank, and also where only the source returns the updates. It broke when the
harness stopped each rank's sharer right after its own export call (``FileNotFoundError``:
the source's listener was gone before the other ranks fetched).

SGLang is imported with this module, as a real client's exporter imports it with its own
module: the rank unpickles the exporter (importing this module) before Megatron's parallel
state exists.
"""

from __future__ import annotations

import pytest

try:
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor,
    )
    from sglang.srt.utils import MultiprocessingSerializer
except ImportError:  # pragma: no cover - SGLang is installed in CI
    LocalSerializedTensor = MultiprocessingSerializer = None

from ..harness import distributed as dh
from ..harness import model_distributed as md
from ..harness.cases import DIST_CASES
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: Engine TP 2 fed by four colocated trainer ranks: two replicas, each with a gather source.
COLOCATED = next(c for c in DIST_CASES if "T.tp4ep1etp2pp1te-R.tp2ep1dp1ug-colocated" in c.id)
#: A whole model (Qwen3.5 with GDN and shared experts) on engine TP 2 x EP 2, colocated.
MODEL_COLOCATED = next(c for c in md.MODEL_DIST_CASES
                       if c.delivery == "colocated" and c.case.receiver.tp == 2 and
                       c.case.receiver.moe_ep == 2 and "q35" in c.id)


class GatherSource(ReferenceImplementation):
    """The reference's per-rank streams, gathered to each replica's first rank and serialized
    there for every engine rank of the replica, as a colocated gather source does.

    ``values``: each tensor wrapped as SGLang's ``LocalSerializedTensor`` (one serialized value
    per engine rank; rank ``k`` reads ``values[k]``), else plain ``(name, tensor)`` lists;
    ``everyone``: the source's updates broadcast to and returned by every rank of the replica
    (else only the source returns them); ``strategy``: torch's CPU sharing strategy while
    serializing."""

    def __init__(self, *, values: bool, everyone: bool, strategy: str) -> None:
        super().__init__()
        self.values, self.everyone, self.strategy = values, everyone, strategy
        self.name = (f"gather-source-{'values' if values else 'pairs'}-"
                     f"{'everyone' if everyone else 'source-only'}-{strategy}")

    def _entry(self, serializer, wrap, streams, k: int, b: int):
        import torch

        pairs = list(streams[k][b]) if b < len(streams[k]) else []
        if not self.values:
            return serializer.serialize(pairs, output_str=True)
        # rank k reads values[k]; the others hold an empty tensor (shared without a descriptor)
        return serializer.serialize(
            [(name, wrap(values=[serializer.serialize(t if j == k else
                                                      torch.empty(0, dtype=t.dtype))
                                 for j in range(len(streams))]))
             for name, t in pairs], output_str=True)

    def export_weights_distributed(self, model_state, **kwargs):
        import torch.distributed as dist
        import torch.multiprocessing as tmp

        from pytest_weightsync.wire import TensorUpdate

        assert kwargs["delivery"] == "colocated"
        own = super().export_weights_distributed(model_state, **kwargs) or []
        tp, rank, world = kwargs["receiver"].tp, dist.get_rank(), dist.get_world_size()
        gathered = [None] * world
        dist.all_gather_object(gathered, [[(n, t.detach().clone()) for n, t in bucket]
                                          for bucket in own])
        before = tmp.get_sharing_strategy()
        mine = None
        for source in range(0, world, tp):
            box = [None]
            if rank == source:
                streams = gathered[source:source + tp]
                tmp.set_sharing_strategy(self.strategy)
                try:
                    box = [[TensorUpdate([self._entry(MultiprocessingSerializer,
                                                      LocalSerializedTensor, streams, k, b)
                                          for k in range(tp)])
                            for b in range(max(len(s) for s in streams))]]
                finally:
                    tmp.set_sharing_strategy(before)
            dist.broadcast_object_list(box, src=source)
            if source == rank - rank % tp:
                mine = box[0]
        return mine if self.everyone or rank % tp == 0 else None


VARIANTS = [
    pytest.param(dict(values=True, everyone=True, strategy="file_descriptor"), id="values-fd"),
    pytest.param(dict(values=False, everyone=True, strategy="file_system"), id="pairs-fs"),
    pytest.param(dict(values=False, everyone=False, strategy="file_descriptor"),
                 id="source-only-fd"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_gather_sources_serialized_updates_land_in_every_engine_rank(rank_pool, variant):
    if MultiprocessingSerializer is None:
        pytest.skip("SGLang does not import here")
    dh.require_megatron()
    exporter = GatherSource(**variant)
    result = dh.run_and_judge(rank_pool, exporter, COLOCATED, ("compat", "direct"))
    assert len(result.checked) == 3  # every update judged bit for bit
    assert result.transports == {"serialized"}


def test_a_whole_model_gather_source_lands_over_every_update(rank_pool):
    if MultiprocessingSerializer is None:
        pytest.skip("SGLang does not import here")
    dh.require_megatron()
    exporter = GatherSource(values=True, everyone=True, strategy="file_descriptor")
    run = md.run(rank_pool, exporter, MODEL_COLOCATED, ("compat",))
    for index in range(len(run.updates)):
        assert md.judge_update(run, index) == MODEL_COLOCATED.case.receiver.tp * (
            MODEL_COLOCATED.world // MODEL_COLOCATED.case.receiver.tp)
