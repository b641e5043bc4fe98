"""Conformance of every registered distributed exporter (``export_weights_distributed``).

Each test runs once per registered implementation with that role, in real gloo ranks (4 for
every case but the EP 8 one, so one warm pool serves them) with Megatron-Core's ``parallel_state`` initialized for the
case's trainer topology and real MoE layers holding each rank's shards. The exporter does its
own collectives; its streams come back and are loaded by the reference receiver of the engine
rank they were sent to, which is judged bit for bit against the independent oracle - and,
where SGLang imports, by every stock SGLang row that claims the format and receiver.

- ``distributed_export_bit_exact``: a pairwise cover of trainer EP 1-8 x ETP 1-2 x PP 1-2 x
  TP 1-4 (both expert module spellings, both deliveries, bucketed and unbucketed streams),
  every format the exporter claims; after EVERY exporter call each rank checks that its
  trainer parameters are bit-identical (the failure names the call, rank, shard, row, col).
"""

from __future__ import annotations

import math

import pytest

from ..harness import claims
from ..harness import distributed as dh
from ..harness.cases import Case, DistCase
from pytest_weightsync.reference_impl.layout import MoESpec, ReceiverTopology, TrainerTopology

#: Trainer world size of every case but the EP 8 one: one warm pool serves them all.
WORLD = 4


def _case(tp, ep, etp, pp, impl, r_tp, r_ep, order="gate_up", padded=False, delivery="colocated",
          bucket_bytes=None, layers_per_stage=1, world=WORLD) -> DistCase:
    stage = world // pp
    trainer = TrainerTopology(tp=tp, ep=ep, etp=etp, pp=pp, dp=stage // tp, expert_impl=impl)
    moe_tp = r_tp // r_ep
    intermediate = math.lcm(etp, moe_tp) * 2
    receiver = ReceiverTopology(tp=r_tp, moe_ep=r_ep, order=order,
                                intermediate_padded=intermediate // moe_tp + 2 if padded else None)
    spec = MoESpec(num_layers=pp * layers_per_stage, num_experts=math.lcm(ep, r_ep), hidden=8,
                   intermediate=intermediate)
    return DistCase(Case(spec, trainer, receiver), delivery, bucket_bytes)


#: Pairwise cover of (tp, ep, etp, pp) over tp {1,2,4} x ep {1,2,4} x etp {1,2} x pp {1,2}
#: within 4 ranks, alternating expert spelling, delivery and bucketing, plus EP 8 in 8 ranks.
CASES = [
    _case(1, 4, 1, 1, "sequential", 4, 4, delivery="colocated"),
    _case(4, 4, 1, 1, "te_grouped", 2, 1, order="up_gate", delivery="distributed",
          bucket_bytes=0),
    _case(2, 4, 1, 1, "sequential", 4, 2, padded=True, delivery="distributed"),
    _case(4, 2, 2, 1, "sequential", 2, 2, delivery="colocated", bucket_bytes=256),
    _case(2, 1, 2, 2, "te_grouped", 4, 1, padded=True, delivery="colocated"),
    _case(1, 2, 2, 1, "sequential", 2, 1, order="up_gate", delivery="distributed"),
    _case(4, 1, 1, 1, "te_grouped", 4, 4, delivery="colocated", layers_per_stage=2),
    _case(1, 1, 2, 2, "sequential", 1, 1, delivery="distributed", bucket_bytes=300),
    _case(1, 2, 1, 2, "te_grouped", 4, 4, order="up_gate", delivery="distributed"),
    _case(2, 2, 1, 2, "sequential", 2, 1, padded=True, delivery="colocated"),
    _case(2, 2, 2, 1, "te_grouped", 4, 2, delivery="colocated", bucket_bytes=0),
    _case(4, 1, 2, 1, "sequential", 1, 1, delivery="distributed"),
    _case(2, 8, 1, 1, "sequential", 8, 8, delivery="colocated", world=8),
]


@pytest.mark.weightsync_property("distributed_export_bit_exact")
@pytest.mark.parametrize("dcase", [pytest.param(c, id=c.id) for c in CASES])
def test_distributed_exporter_streams_land_bit_exact(weightsync_distributed_exporter, dcase,
                                                      rank_pool):
    exporter = weightsync_distributed_exporter
    dh.require_claim(exporter, dcase)
    formats = claims.claimed_formats(exporter, "distributed_exporter", dcase.case, dh.FORMATS)
    if not formats:
        claims.skip_unclaimed(f"{exporter.name} claims none of {dh.FORMATS} for this receiver")
    dh.require_megatron()
    checked = dh.run_and_judge(rank_pool, exporter, dcase, formats)
    assert set(checked) == set(formats)
