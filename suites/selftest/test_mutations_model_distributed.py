"""The whole-model distributed check catches planted exporter bugs in real ranks, and names them.

Each mutant is the reference distributed whole-model exporter, run in real Megatron ranks
(:mod:`suites.harness.model_distributed`), with one bug public RL stacks shipped: every
pipeline stage publishing its layers under stage-local numbers (NeMo-RL#3259: the first
writer wins, the later stages' layers are never refit), and a float32 router gathered through
a bf16 buffer (miles#811, prime-rl#3524). The suite's own judging of the first update must fail,
name the pattern and locate it (parameter, layer).
"""

from __future__ import annotations

import re

import pytest

from ..harness import judge
from ..harness import model_distributed as md
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


def _case(fragment: str):
    return next(c for c in md.MODEL_DIST_CASES if fragment in c.id)


#: PP 2 with 2 + 1 layers: stage 1's layer 2 is its local layer 0.
UNEVEN_PP = _case("-first2-")
#: A float32 router and float32 expert bias on dense TP 2.
FP32_ROUTER = _case("-r32-")


class _Planted(ReferenceImplementation):
    """The reference distributed whole-model exporter with its gathered checkpoint and its
    payloads open to a planted bug."""

    def gathered(self, weights):
        return weights

    def payload(self, pairs, spec, trainer, stage_starts):
        return pairs

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from pytest_weightsync.reference_impl import distributed_model_export as dme
        from pytest_weightsync.reference_impl import model_senders
        from pytest_weightsync.reference_impl.distributed_export import engine_streams

        weights = self.gathered(dme.gather_model(spec, trainer, model_state, config=config,
                                                 model=model))
        starts = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(starts, dme.layer_offset(config, model),
                               group=ps.get_pipeline_model_parallel_group())

        def export(fmt, spec, receiver, engine_rank, full):
            pairs = model_senders.export(fmt, spec, receiver, engine_rank, full)
            return self.payload(pairs, spec, trainer, starts)

        return engine_streams(weights, format=format, spec=spec, receiver=receiver,
                              delivery=delivery, bucket_bytes=bucket_bytes, export=export)


class StageLocalLayerNumbers(_Planted):
    """Each stage names its layers from 0 (the module index, not ``layer_number - 1``)."""

    name = "mutant-model-dist-stage-local-layers"

    def payload(self, pairs, spec, trainer, stage_starts):
        def local(match):
            layer = int(match.group(1))
            return str(layer - max(s for s in stage_starts if s <= layer))

        return [(re.sub(r"(?<=^model\.layers\.)(\d+)", local, n), t) for n, t in pairs]


class RouterGatheredAsBf16(_Planted):
    """The float32 router weight travels through a bf16 gather buffer."""

    name = "mutant-model-dist-router-bf16"

    def gathered(self, weights):
        import torch

        for name, tensor in weights.dense.items():
            if name.endswith("mlp.gate.weight"):
                weights.dense[name] = tensor.to(torch.bfloat16)
        return weights


def _fails(rank_pool, impl, mcase, formats) -> str:
    with pytest.raises(judge.ConformanceError) as info:
        md.judge_update(md.run(rank_pool, impl, mcase, formats), 0)
    return str(info.value)


def test_stage_local_layer_numbers_are_killed_named_and_located(rank_pool):
    message = _fails(rank_pool, StageLocalLayerNumbers(), UNEVEN_PP, ["compat"])
    assert ("the pattern of pipeline-stage-local layer numbering: each of the 2 stages named "
            "its layers from 0, so layers [0] arrive more than once and layers [2] never"
            ) in message, message
    assert "written twice" in message and "model.layers.0." in message, message
    assert re.search(r"never written: \d+ tensor\(s\), e\.g\. \['model\.layers\.2\.", message), \
        message
    assert "layers [2]" in message, message


@pytest.mark.parametrize("fmt", ["compat", "direct"])
def test_fp32_router_cast_to_bf16_is_killed_and_named(rank_pool, fmt):
    message = _fails(rank_pool, RouterGatheredAsBf16(), FP32_ROUTER, [fmt])
    want = "a float32 tensor cut to bf16" if fmt == "compat" else "cast through bf16"
    assert want in message, message
    assert "model.layers.0.mlp.gate.weight" in message, message
