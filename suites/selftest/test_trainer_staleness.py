"""Trainer memory that still holds the previous version when the refit reads.

With Megatron's distributed optimizer and ``overlap_param_gather=True`` each DP rank's
optimizer step refreshes only its own shard of every parameter buffer; the all-gather that
brings the others runs in the next training forward. An exporter that reads the parameters
then exports its own fresh shard beside stale copies of the others (NVIDIA-NeMo/RL#4086).
The ``-afterstep`` whole-model case builds real megatron-core DDP with both settings and
leaves every version that way (``reference_impl/trainer/param_sync.py``); a correct exporter
completes the gather first (megatron-core's ``start_param_sync(force_sync=True)``).

The ``-relocated`` case moves every parameter to new storage after each step, as a trainer
that offloads and reloads, or packs, its weights does (Megatron-LM#7448: the packing
relocated the storage a refit kept reading); an exporter that reads views it kept from an
earlier call exports the previous version. Both are named ``stale trainer shard``. Both
cases are in the whole-model distributed matrix, so the conformance suite
(``suites/conformance/test_model_distributed.py``) runs the reference on them: it completes
the gather and reads the tensors it is given.
"""

from __future__ import annotations

import re

import pytest

from pytest_weightsync.reference_impl.impl import ReferenceImplementation

from ..harness import judge
from ..harness import model_distributed as md

pytestmark = pytest.mark.weightsync_property("mutation_detected")

AFTER_STEP = next(c for c in md.MODEL_DIST_CASES if c.trainer_state == "after_step")
RELOCATED = next(c for c in md.MODEL_DIST_CASES if c.trainer_state == "relocated")


class ReadsBeforeTheGather(ReferenceImplementation):
    """The reference whole-model exporter without its param sync: it reads the parameters as
    the optimizer step left them."""

    name = "mutant-reads-before-the-param-gather"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None, engine=None):
        from pytest_weightsync.reference_impl.senders import distributed_model_export as dme
        from pytest_weightsync.reference_impl.senders import model_senders

        return dme.engine_streams(
            dme.gather_model(spec, trainer, model_state, config=config, model=model),
            format=format, spec=spec, receiver=receiver, delivery=delivery,
            bucket_bytes=bucket_bytes, export=model_senders.export)


def test_an_exporter_that_reads_before_the_gather_is_named_stale_trainer_shard(rank_pool):
    result = md.run(rank_pool, ReadsBeforeTheGather(), AFTER_STEP, ["compat", "direct"])
    assert md.judge_update(result, 0)  # the first version is written whole: nothing stale yet
    with pytest.raises(judge.ConformanceError) as info:
        md.judge_update(result, 1)
    message = str(info.value)
    assert "stale trainer shard: parameters read where the trainer still held the previous" \
        in message, message[:3000]
    assert "another DP rank's shard of the trainer's parameter buffer, not gathered yet" in \
        message, message[:3000]
    # each parameter located: its first stale element, in a parameter of the previous version
    # whole (another DP rank's shard) or in part (a parameter across two shards)
    assert re.search(r"- stale trainer shard: model\.\S+: (it holds version 1's values|\d+ "
                     r"of \d+ elements hold version 1's values).*\(first at .*row=\d+ col=\d+",
                     message), message[:3000]


class KeepsItsFirstViews(ReferenceImplementation):
    """The reference whole-model exporter reading views of the parameters it kept from its
    first call (an exporter that caches its tensor list, or IPC handles, once)."""

    name = "mutant-reads-kept-views"

    def export_weights_distributed(self, model_state, **kwargs):
        if not hasattr(self, "kept"):
            self.kept = {name: tensor.detach() for name, tensor in model_state.items()}
        return super().export_weights_distributed(self.kept, **kwargs)


def test_an_exporter_that_reads_views_it_kept_is_named_stale_trainer_shard(rank_pool):
    result = md.run(rank_pool, KeepsItsFirstViews(), RELOCATED, ["compat", "direct"])
    assert md.judge_update(result, 0)
    with pytest.raises(judge.ConformanceError) as info:
        md.judge_update(result, 1)
    message = str(info.value)
    assert "stale trainer shard: parameters read where the trainer still held the previous" \
        in message, message[:3000]
    assert re.search(r"- stale trainer shard: model\.\S+: it holds version 1's values: it was "
                     r"read from storage the parameter left after the step.*\(first at "
                     r".*row=\d+ col=\d+", message), message[:3000]
