"""CUDA graphs captured on the receiver's MoE forward survive in-place updates.

SGLang captures CUDA graphs of its forward at startup; a weight update that reallocates a
parameter (instead of copying into it) leaves the graph reading the old storage, and the
engine keeps serving the old policy without any error. For each sync path (compat, packed,
direct) a graph of the reference MoE forward (:mod:`pytest_weightsync.reference_impl.oracle.moe_forward`) is captured
over the receiver's live ``w13``/``w2`` after one update and replayed after the next: its
output must be bit-equal to an eager forward over separately built tensors holding the new
weights (same kernels, same shapes), and different from the old output.
"""

from __future__ import annotations

import pytest

from . import gpu_harness as h
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology

pytestmark = [pytest.mark.gpu, pytest.mark.weightsync_property("cuda-graph")]

SPEC = MoESpec(num_layers=1, num_experts=16, hidden=512, intermediate=256)

SCENARIOS = [
    pytest.param(h.Scenario(SPEC, ReceiverTopology(tp=1), tokens=64, top_k=8), id="moe_tp1"),
    pytest.param(h.Scenario(SPEC, ReceiverTopology(tp=4, moe_ep=2, order="up_gate"), tokens=64,
                            top_k=8), id="moe_tp2-ep2-up_gate"),
    pytest.param(h.Scenario(SPEC, ReceiverTopology(tp=2, intermediate_padded=160), tokens=64,
                            top_k=8), id="moe_tp2-padded"),
]


@pytest.mark.parametrize("path", h.PATHS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_graph_captured_before_an_update_replays_the_new_weights_exactly(scenario, path):
    log = h.run_updates(scenario, path, [0, 1, 2], "cuda", graphs=True)
    assert log.graph_checks == 3 * scenario.topo.world_size * SPEC.num_layers
    assert all(changed > 0 for changed in log.changed_elements[1:]), log.changed_elements


def test_graph_that_reads_a_reallocated_parameter_is_caught():
    """The check can fail: rebinding a parameter to new storage (what a non-in-place loader
    does) leaves the graph on the old weights, and the replay no longer matches eager."""
    import torch

    from pytest_weightsync.reference_impl.model.layout import fused_name

    scenario = h.Scenario(SPEC, ReceiverTopology(tp=1), tokens=64, top_k=8)
    (receiver,) = h.make_receivers(SPEC, scenario.topo, "cuda")
    hidden, logits = h.forward_inputs(scenario, "cuda")
    h.update([receiver], "direct", h.full_weights(SPEC, 0, "cuda", finite=True))
    graph = h.capture(receiver.params, scenario, 0, 0, hidden, logits[0])
    name = fused_name(0, "w13")
    stale = receiver.params[name]  # kept alive: the graph keeps reading version 0
    receiver.params[name] = torch.empty_like(stale)  # reallocated instead of copied into
    h.update([receiver], "direct", h.full_weights(SPEC, 1, "cuda", finite=True))
    expected = h.expected_params(SPEC, scenario.topo, 0, 1, "cuda", finite=True)
    eager = h.forward(expected, scenario, 0, 0, hidden, logits[0])
    with pytest.raises(AssertionError, match="differ bitwise"):
        h.assert_bits_equal(graph.replay().clone(), eager, "replay over a reallocated w13")


def test_moe_forward_makes_no_host_sync():
    """Graph capture needs a forward that never waits for the device; sync debug mode turns
    any synchronizing call into an error."""
    import torch

    scenario = h.Scenario(SPEC, ReceiverTopology(tp=2, moe_ep=2), tokens=64, top_k=8)
    receivers = h.make_receivers(SPEC, scenario.topo, "cuda")
    hidden, logits = h.forward_inputs(scenario, "cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for receiver in receivers:
            h.forward(receiver.params, scenario, receiver.rank, 0, hidden, logits[0])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
