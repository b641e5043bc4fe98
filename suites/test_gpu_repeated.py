"""Repeated in-place updates on the GPU: every one exact, every output exact.

A receiver that is right once can still go wrong the tenth time: a buffer reallocated by a
later update, a stale staging buffer reused, a CUDA graph still pointing at last update's
storage, a cached plan built for the first payload's addresses. Each test sends 20+ versions
of synthetic weights (every element changes between two versions) along one sync path, and
after every update checks parameters bit for bit at unchanged addresses and MoE outputs
(eager and CUDA-graph replay) bit for bit against an eager forward over the expected weights.
The same scenario runs on CPU in tests/test_gpu_suites_cpu.py.
"""

from __future__ import annotations

import pytest

import gpu_harness as h
from reference_impl.layout import MoESpec, ReceiverTopology

pytestmark = [pytest.mark.gpu, pytest.mark.weightsync_property("repeated-updates")]

UPDATES = 24
SPEC = MoESpec(num_layers=2, num_experts=8, hidden=256, intermediate=128)

SCENARIOS = [
    pytest.param(h.Scenario(SPEC, ReceiverTopology(tp=2), tokens=32, top_k=4), id="moe_tp2"),
    pytest.param(h.Scenario(MoESpec(1, 8, 192, 96),
                            ReceiverTopology(tp=2, moe_ep=2, order="up_gate", intermediate_padded=112),
                            tokens=24, top_k=2), id="moe_ep2-up_gate-padded"),
]


@pytest.mark.parametrize("path", h.PATHS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_one_of_many_updates_is_exact_in_params_and_outputs(scenario, path):
    log = h.run_updates(scenario, path, range(UPDATES), "cuda", graphs=True)
    ranks, layers = scenario.topo.world_size, scenario.spec.num_layers
    assert log.outputs_checked == UPDATES * ranks * layers
    assert log.graph_checks == UPDATES * ranks * layers
    assert all(changed > 0 for changed in log.changed_elements[1:]), log.changed_elements


def test_versions_that_wrap_the_mask_cycle_and_go_back_are_still_exact():
    """Versions 0..255 mask-wrap (version v and v+256 hold the same bits); going back to an
    older version, then forward again, must still land exactly."""
    scenario = h.Scenario(SPEC, ReceiverTopology(tp=2), tokens=16, top_k=2)
    versions = [0, 1, 2, 255, 256 + 7, 3, 2, 1, 0, 1, 40, 41]
    log = h.run_updates(scenario, "direct", versions, "cuda", graphs=True)
    assert log.outputs_checked == len(versions) * 2 * SPEC.num_layers
