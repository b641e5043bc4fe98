"""A finding blames the side of the sync that can be wrong.

In the loader suites the payload is the harness's own (built from the oracle), so a loader's
wrong expert offset must be named as the loader's - not as "interleaved trainer expert
numbering", which the same wrong bits also look like on an EP 8 engine fed by an EP 4 trainer.
The mutant is a compat loader of vLLM's shape (a global -> local expert map per rank) whose
EP rank base counts the experts per rank over a hard-coded EP 4: engine MoE-EP rank ``r`` takes
experts ``2r, 2r + 1, ...`` instead of its own block of one, and ranks past the experts raise
``IndexError`` building the map.
"""

from __future__ import annotations

import re

import pytest
import torch

from pytest_weightsync import compare
from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology

from ..harness import inputs, judge, loader
from ..harness.cases import Case

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: Eight experts on an EP 8 engine (one each), sent from an EP 4 trainer: on engine rank 1 the
#: mutant's expert 2 is exactly where the trainer's interleaved numbering would put it.
CASE = Case(MoESpec(num_layers=1, num_experts=8, hidden=8, intermediate=2),
            TrainerTopology(ep=4), ReceiverTopology(tp=8, moe_ep=8))
NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


class WrongEPRankBase:
    """Offsets the experts of engine MoE-EP rank ``r`` by ``r * (E // 4)``, not ``r * E/EP``."""

    name = "wrong-ep-rank-base"
    capabilities = Capabilities(formats={"compat"}, padded=False)

    def load_weights(self, params, payload, *, format, spec, topology, rank):
        local = spec.num_experts // topology.moe_ep
        ep_rank = (rank // topology.moe_tp) % topology.moe_ep
        base = ep_rank * (spec.num_experts // 4)  # the bug: experts per rank over EP 4
        expert_map = [-1] * spec.num_experts
        for slot in range(local):
            expert_map[base + slot] = slot  # IndexError once base runs past the experts
        rows = spec.intermediate // topology.moe_tp
        start = rows * (rank % topology.moe_tp)
        first = "gate" if topology.order == "gate_up" else "up"
        with torch.no_grad():
            for name, tensor in payload:
                layer, expert, proj = NAME.fullmatch(name).groups()
                slot = expert_map[int(expert)]
                if slot < 0:
                    continue
                prefix = f"model.layers.{layer}.mlp.experts."
                if proj == "down":
                    params[prefix + "w2_weight"][slot].copy_(tensor[:, start:start + rows])
                else:
                    half = 0 if proj == first else rows
                    params[prefix + "w13_weight"][slot, half:half + rows].copy_(
                        tensor[start:start + rows])


def _loaded(rank: int):
    params = inputs.receiver_params(CASE, rank)
    before = compare.snapshot(params)
    loader.load(WrongEPRankBase(), params, "compat", CASE, rank, version=1, bucket=None)
    return params, before


def test_the_loaders_wrong_ep_rank_base_is_blamed_on_the_loader():
    params, before = _loaded(1)
    with pytest.raises(judge.ConformanceError) as info:
        judge.check_rank(params, CASE, 1, 1, before)  # the loader suites' side
    first = str(info.value).splitlines()[0]
    assert first == ("experts misplaced: receiver rank 1's slot for expert 1 holds expert 2's "
                     "values (1 of 1 local experts) - wrong EP rank base: the loader gave engine "
                     "MoE-EP rank 1 expert 2 (base 1 * 2) instead of its block's expert 1 (base "
                     "1 * 1, its 1 local expert)"), first
    assert "trainer" not in first
    assert info.value.location.expert == 1 and info.value.location.rank == 1


def test_the_same_bits_from_an_exporter_may_be_its_trainer_numbering():
    """Judged as an exporter's output (the receiver the reference), the trainer's interleaved
    numbering is a cause the exporter can have: both are named."""
    params, before = _loaded(1)
    with pytest.raises(judge.ConformanceError) as info:
        judge.check_rank(params, CASE, 1, 1, before, side="exporter")
    first = str(info.value).splitlines()[0]
    assert "wrong EP rank base: the exporter gave engine MoE-EP rank 1 expert 2" in first, first
    assert " or interleaved trainer expert numbering (global id = local * EP + ep_rank over " \
           "trainer EP 4" in first, first


def test_ranks_past_the_experts_raise_in_the_loader():
    with pytest.raises(IndexError):
        _loaded(4)
