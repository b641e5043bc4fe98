"""Megatron-Core's own expert forward as an oracle for the reference's shard layout.

The reference says trainer rank ``r`` of an ETP group holds ``linear_fc1 = [gate_r; up_r]`` and
``linear_fc2 = down[:, cols_r]`` (:func:`~pytest_weightsync.reference_impl.trainer.trainer.trainer_state`).
Comparing the reference's gather with those same shards cannot catch a wrong convention - both
sides would share it. Running the model can: the real ``SequentialMLP`` experts (CPU, float32,
gloo ranks) are loaded with the reference's shards and given a few tokens per local expert
through the experts module's own ``forward(hidden, tokens_per_expert, probs)``. Megatron
computes ``silu(x @ fc1_gate^T) * (x @ fc1_up^T)`` by chunking each rank's fc1 output in two
and then a partial ``fc2``; the ETP partial sums are added here (Megatron leaves that
reduction to the token dispatcher). The result must equal ``silu(x gate^T) * (x up^T) down^T``
computed in float64 from the reference's *full* HF weights. A shard holding ``[up_r; gate_r]``,
a contiguous slice of ``[gate; up]`` or a wrong fc2 column block changes the output.

Weights come from the synthetic generator's finite values with their exponent dropped
(``frexp`` mantissa, magnitude in [0.5, 1)), so products stay well conditioned: float32 vs
float64 differ by rounding only, and the tolerance is float32's.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.weightsync_backend("megatron"), pytest.mark.weightsync_property("trainer_layout")]

WORLD = 4
HIDDEN, FFN, EXPERTS, TOKENS = 8, 4, 4, 3


def _forward_safe_weights(spec):
    """``{0: (ExpertWeights, ...)}``: synthetic values (finite set) scaled to [0.5, 1) magnitude."""
    import torch

    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.model.layout import ExpertWeights

    experts = []
    for expert in range(spec.num_experts):
        parts = {}
        for projection in ("gate", "up", "down"):
            rows, cols = spec.hf_shape(projection)
            values = synth.expert_block(spec, 5, 0, expert, projection, torch.arange(rows), torch.arange(cols), finite=True)
            parts[projection] = torch.frexp(values).mantissa.to(spec.dtype).contiguous()
        experts.append(ExpertWeights(**parts))
    return {0: tuple(experts)}


def _tokens():
    import torch

    return (torch.arange(TOKENS * HIDDEN, dtype=torch.float64).reshape(TOKENS, HIDDEN) % 7 - 3) / 4


def _expected(weights, swap=False):
    """``silu(x gate^T) * (x up^T) down^T`` in float64 (``swap``: the wrong convention)."""
    import torch

    x = _tokens()
    gate, up, down = (weights[p].double() for p in ("gate", "up", "down"))
    if swap:
        gate, up = up, gate
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def expert_forward_in_rank(tp, ep, etp):
    """One rank: real SequentialMLP with the reference's shards; outputs of its local experts."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pytest_weightsync.reference_impl.backends.megatron import MegatronMoEConfig, megatron_moe_layer, write_expert_shards
    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology
    from pytest_weightsync.reference_impl.trainer.trainer import trainer_state

    rank = dist.get_rank()
    spec = MoESpec(num_layers=1, num_experts=EXPERTS, hidden=HIDDEN, intermediate=FFN, dtype=torch.float32)
    topo = TrainerTopology(tp=tp, ep=ep, etp=etp, dp=WORLD // tp)
    full = _forward_safe_weights(spec)
    prefix = "decoder.layers.0.mlp."
    state = trainer_state(spec, topo, rank, full)
    cfg = MegatronMoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, tp=tp, ep=ep, etp=etp,
                            dtype="float32")
    with megatron_moe_layer(cfg) as (layer, placement):
        write_expert_shards(layer, {name[len(prefix):]: t for name, t in state.items()})
        local = len(placement.local_expert_indices)
        hidden = _tokens().float().repeat(local, 1)  # TOKENS tokens routed to each local expert
        with torch.no_grad():
            partial, bias = layer.experts(hidden, torch.tensor([TOKENS] * local), torch.ones(TOKENS * local))
        assert bias is None
        # fc2 is row-parallel over the ETP group and not reduced inside the experts: add the
        # partial sums of the ETP ranks, in ETP-rank order.
        group = ps.get_expert_tensor_parallel_group()
        pieces = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, partial.contiguous(), group=group)
        output = torch.stack(pieces).sum(dim=0)
    results = {}
    for index, expert in enumerate(placement.local_expert_indices):
        got = output[index * TOKENS:(index + 1) * TOKENS].double()
        want = _expected(full[0][expert])
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-4,
            msg=lambda m, e=expert: f"rank {rank}: Megatron's expert {e} forward != silu(gate)*up->down: {m}",
        )
        results[expert] = bool(torch.allclose(got, _expected(full[0][expert], swap=True), rtol=1e-3, atol=1e-2))
    return results


@pytest.fixture(scope="module")
def megatron_available():
    """Cheap check in the pytest process (no megatron import); the ranks import it."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        found = False
    if not found:
        pytest.skip("megatron is not importable: megatron-core is not installed")


@pytest.mark.parametrize(
    "tp, ep, etp",
    [
        pytest.param(2, 1, 2, id="tp2-ep1-etp2"),
        pytest.param(2, 2, 2, id="tp2-ep2-etp2"),
        pytest.param(1, 4, 1, id="tp1-ep4-etp1"),
    ],
)
def test_megatron_expert_forward_matches_full_weight_swiglu(megatron_available, rank_pool, tp, ep, etp):
    results = rank_pool.run(expert_forward_in_rank, WORLD, tp, ep, etp)
    covered = sorted({expert for r in results for expert in r})
    assert covered == list(range(EXPERTS)), f"experts run: {covered}"
    # Control: the swapped convention silu(up) * gate gives a different output for every
    # expert, so the oracle tells [gate_r; up_r] from [up_r; gate_r].
    assert not any(matches for r in results for matches in r.values()), results
