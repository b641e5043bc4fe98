"""The reference's trainer-side model agrees with real Megatron-Core MoE layers.

Real ``MoELayer``s (SequentialMLP experts, CPU initialization, allgather dispatcher) are built
in four gloo ranks at each essential expert topology. In every rank the suite checks that the
reference's ownership model (:func:`pytest_weightsync.reference_impl.model.layout.trainer_shard`) puts the rank where
Megatron's ``parallel_state`` puts it, and that the reference's parameter names and shapes are
the layer's own. It then writes the reference's synthetic shards into the real parameters,
exports them through the reference trainer-side gather and requires the synthetic HF tensors
bit for bit. Independently of the reference, Megatron's own distributed-checkpoint metadata
(``sharded_state_dict``) assembles the same shards into global tensors, which must again be
the synthetic HF tensors: this is what catches a shard layout the reference got wrong (e.g.
fc1 under ETP as a contiguous slice of ``[gate; up]``).

TEGroupedMLP (Transformer Engine, CUDA) is never built here. Its naming is checked against
Megatron-Core's own code instead of the reference's renaming: the shards under the reference's
``linear_fc{1,2}.weight{i}`` names go through the real ``TEGroupedMLP.sharded_state_dict`` and
``TEGroupedLinear._sharded_state_dict_grouped`` (compiled from the installed source, as the class
needs TE), whose keys must be the reference's names and whose global placement must equal
SequentialMLP's. What stays unmodelled: TE's parameter allocation and ``_load_from_state_dict``.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.backends.megatron import (
    MegatronMoEConfig,
    assemble_checkpoint,
    checkpoint_pieces,
    expert_parameters,
    megatron_moe_layer,
    pieces_of_sharded_state_dict,
    read_expert_shards,
    te_grouped_names,
    te_grouped_sharded_state_dict,
    write_expert_shards,
)

pytestmark = [pytest.mark.weightsync_backend("megatron"), pytest.mark.weightsync_property("trainer_layout")]

WORLD = 4
HIDDEN, FFN, EXPERTS = 10, 6, 4
#: Layer prefix of the MoE layer inside a GPT model (what the reference's names carry).
PREFIX = "decoder.layers.0.mlp."

#: (tp, ep, etp) at world size 4: EP 1/2/4, ETP 1/2, ETP>1 with EP==1, dense TP 2.
TOPOLOGIES = [
    pytest.param(1, 1, 2, id="tp1-ep1-etp2"),
    pytest.param(1, 2, 1, id="tp1-ep2-etp1"),
    pytest.param(1, 2, 2, id="tp1-ep2-etp2"),
    pytest.param(1, 4, 1, id="tp1-ep4-etp1"),
    pytest.param(2, 2, 1, id="tp2-ep2-etp1"),
]


def _megatron_installed() -> bool:
    """Whether megatron-core is findable, without importing it in the pytest process."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


class _WorldPool:
    """``rank_pool`` at this module's world size. The session's warm 4-rank pool is shared with
    the other Megatron suites (forward oracle, Bridge), so Megatron is imported once per rank."""

    def __init__(self, rank_pool):
        self._rank_pool = rank_pool

    def run(self, fn, *args):
        return self._rank_pool.run(fn, WORLD, *args)


@pytest.fixture
def megatron_pool(rank_pool):
    if not _megatron_installed():
        pytest.skip("megatron is not importable: megatron-core is not installed")
    return _WorldPool(rank_pool)


def _spec_and_topology(tp, ep, etp, expert_impl="sequential"):
    import torch

    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology

    spec = MoESpec(num_layers=1, num_experts=EXPERTS, hidden=HIDDEN, intermediate=FFN, dtype=torch.bfloat16)
    return spec, TrainerTopology(tp=tp, ep=ep, etp=etp, dp=WORLD // tp, expert_impl=expert_impl)


def _assert_full_equal(actual, expected, what):
    from pytest_weightsync.compare import assert_bitwise_equal

    assert sorted(actual) == sorted(expected), f"{what}: layers {sorted(actual)} != {sorted(expected)}"
    for layer, experts in expected.items():
        assert len(actual[layer]) == len(experts), f"{what}: layer {layer} expert count differs"
        for expert, weights in enumerate(experts):
            for projection in ("gate", "up", "down"):
                assert_bitwise_equal(
                    actual[layer][expert][projection],
                    weights[projection],
                    name=f"{what} layer={layer} expert={expert} projection={projection}",
                )


def megatron_export_in_rank(tp, ep, etp, version):
    """One rank: build the real layer, check naming/ownership, load, export, compare."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.senders import compat
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.model.layout import trainer_shard
    from pytest_weightsync.reference_impl.trainer.trainer import TrainerGroups, gather_full_weights_dist, trainer_state

    rank = dist.get_rank()
    spec, topo = _spec_and_topology(tp, ep, etp)
    full = synth.full_weights(spec, version)
    ref_state = trainer_state(spec, topo, rank, full)
    ref = trainer_shard(spec, topo, rank)
    cfg = MegatronMoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, tp=tp, ep=ep, etp=etp)
    with megatron_moe_layer(cfg) as (layer, placement):
        # Ownership: the reference's rank order is Megatron's.
        assert (placement.tp_rank, placement.ep_rank, placement.etp_rank) == (ref.tp_rank, ref.ep_rank, ref.etp_rank), (
            f"rank {rank}: Megatron placed it at (tp, ep, etp)="
            f"{(placement.tp_rank, placement.ep_rank, placement.etp_rank)}, the reference at "
            f"{(ref.tp_rank, ref.ep_rank, ref.etp_rank)}"
        )
        assert placement.local_expert_indices == tuple(ref.experts), (
            f"rank {rank}: Megatron's local experts {placement.local_expert_indices}, "
            f"the reference's {tuple(ref.experts)}"
        )
        # Naming and shapes: the reference's names are the layer's own parameter names.
        params = {PREFIX + p.name: p for p in expert_parameters(layer)}
        assert sorted(params) == sorted(ref_state), (
            f"rank {rank}: layer parameters {sorted(params)} != reference names {sorted(ref_state)}"
        )
        for name, p in params.items():
            assert p.shape == tuple(ref_state[name].shape), f"{name}: layer {p.shape}, reference {tuple(ref_state[name].shape)}"
            assert p.global_expert == ref.global_expert(p.local_expert), f"{name}: global expert id differs"
            # Partition attributes the trainer-side gather relies on (missing ones sent ETP
            # shards ungathered in the wild).
            expected_dim = 0 if p.projection == "linear_fc1" else 1
            assert p.tensor_model_parallel is True, f"{name}: tensor_model_parallel={p.tensor_model_parallel}"
            assert p.partition_dim == expected_dim, f"{name}: partition_dim={p.partition_dim}, expected {expected_dim}"
        # Load the synthetic shards the way a trainer holds them, read them back from the layer.
        write_expert_shards(layer, {name[len(PREFIX):]: t for name, t in ref_state.items()})
        held = {PREFIX + name: t for name, t in read_expert_shards(layer).items()}
        groups = TrainerGroups.create(spec, topo)
        try:
            gathered = gather_full_weights_dist(spec, topo, held, groups)
            _assert_full_equal(gathered, full, f"trainer gather on rank {rank}")
            # The same shards under TEGroupedMLP naming (linear_fc1.weight{i}).
            te_spec, te_topo = _spec_and_topology(tp, ep, etp, expert_impl="te_grouped")
            te_held = te_grouped_names(held)
            assert sorted(te_held) == sorted(trainer_state(te_spec, te_topo, rank, full)), "TEGroupedMLP names differ"
            _assert_full_equal(gather_full_weights_dist(te_spec, te_topo, te_held, groups), full, f"TE-named gather on rank {rank}")
        finally:
            groups.destroy()
        # The HF export (compat payload) names and bits.
        exported = compat.export(gathered)
        expected_payload = compat.export(full)
        assert [n for n, _ in exported] == [n for n, _ in expected_payload]
        # TEGroupedMLP naming against Megatron's own TEGroupedMLP checkpoint code (its
        # sharded_state_dict and TEGroupedLinear's per-GEMM keys): the reference's
        # linear_fc{1,2}.weight{i} must be the keys Megatron writes, placed at the global expert
        # the reference gives local GEMM i (checked by assembling in the test).
        te_sharded = te_grouped_sharded_state_dict(layer, {name[len(PREFIX):]: t for name, t in te_held.items()})
        te_keys = sorted(k for k in te_sharded if "._extra_state" not in k)
        assert te_keys == sorted(name[len(PREFIX):] for name in te_held), (
            f"rank {rank}: Megatron's TEGroupedMLP keys {te_keys} != the reference's TE names"
        )
        return {
            "placement": placement,
            "pieces": checkpoint_pieces(layer),
            "te_pieces": pieces_of_sharded_state_dict(te_sharded),
            "hf_names": [n for n, _ in exported],
        }


@pytest.mark.parametrize("tp, ep, etp", TOPOLOGIES)
def test_megatron_layer_shards_export_to_reference_hf_tensors(megatron_pool, tp, ep, etp):
    results = megatron_pool.run(megatron_export_in_rank, tp, ep, etp, 3)
    from pytest_weightsync.reference_impl.oracle import synth

    spec, topo = _spec_and_topology(tp, ep, etp)
    full = synth.full_weights(spec, 3)
    # Megatron's own checkpoint metadata places every shard: assemble and compare.
    pieces = [piece for result in results for piece in result["pieces"]]
    checkpoint = assemble_checkpoint(pieces)
    assert set(checkpoint) == {"linear_fc1", "linear_fc2"}
    assert tuple(checkpoint["linear_fc1"].shape) == (EXPERTS, 2 * FFN, HIDDEN)
    assert tuple(checkpoint["linear_fc2"].shape) == (EXPERTS, HIDDEN, FFN)
    from pytest_weightsync.compare import assert_bitwise_equal

    for expert, weights in enumerate(full[0]):
        fc1 = checkpoint["linear_fc1"][expert]
        assert_bitwise_equal(fc1[:FFN], weights.gate, name=f"Megatron checkpoint fc1 gate rows, expert {expert}")
        assert_bitwise_equal(fc1[FFN:], weights.up, name=f"Megatron checkpoint fc1 up rows, expert {expert}")
        assert_bitwise_equal(checkpoint["linear_fc2"][expert], weights.down, name=f"Megatron checkpoint fc2, expert {expert}")
    # The same shards under TEGroupedMLP names, placed by Megatron's TEGroupedMLP code.
    te_checkpoint = assemble_checkpoint([piece for result in results for piece in result["te_pieces"]])
    for projection in ("linear_fc1", "linear_fc2"):
        assert_bitwise_equal(te_checkpoint[projection], checkpoint[projection], name=f"TEGroupedMLP checkpoint {projection}")
    # Every rank exported the same full HF payload.
    assert all(r["hf_names"] == results[0]["hf_names"] for r in results)
    assert len(results[0]["hf_names"]) == 3 * EXPERTS


def naive_etp_concat_in_rank():
    """Concatenate the real layer's ETP fc1 shards as if fc1 were split contiguously."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer.trainer import trainer_state

    spec, topo = _spec_and_topology(1, 1, 2)
    full = synth.full_weights(spec, 3)
    state = trainer_state(spec, topo, dist.get_rank(), full)
    cfg = MegatronMoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, etp=2)
    with megatron_moe_layer(cfg) as (layer, _):
        write_expert_shards(layer, {name[len(PREFIX):]: t for name, t in state.items()})
        pieces = checkpoint_pieces(layer)
        fc1 = read_expert_shards(layer)["experts.local_experts.0.linear_fc1.weight"]
    return fc1, pieces, torch.cat([full[0][0].gate, full[0][0].up])


def test_megatron_checkpoint_oracle_rejects_contiguous_etp_concat(megatron_pool):
    """The oracle can fail: concatenating ETP fc1 shards is not ``[gate; up]``, and
    Megatron's metadata disagrees with it."""
    import torch

    results = megatron_pool.run(naive_etp_concat_in_rank)
    etp_shards = [results[r][0] for r in (0, 1)]  # ranks 0 and 1 form one ETP group
    naive = torch.cat(etp_shards)
    gate_up = results[0][2]
    assert not torch.equal(naive.view(torch.int16), gate_up.view(torch.int16)), (
        "contiguous concatenation of ETP fc1 shards equalled [gate; up]; the layout is not exercised"
    )
    checkpoint = assemble_checkpoint([p for r in results for p in r[1]])
    assert torch.equal(checkpoint["linear_fc1"][0].view(torch.int16), gate_up.view(torch.int16))
