"""Expert weight sync, single process: every path lands bit-identical on every receiver rank.

Properties checked on the topology matrix (``moe_case``) and on Hypothesis-drawn topologies:
compat, hf_fused, packed and direct payloads, sent as bucket streams, each leave every
receiver rank's parameters equal, bit for bit, to the expected state computed independently
from the synthetic value function, at unchanged addresses; successive versions leave no stale value; the layout model covers every
element exactly once and refuses impossible topologies by name; path selection falls back
with a reason.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_weightsync.vocabulary import BUCKET_LIMITS, FORMATS

from ..harness import cases as matrix
from ..harness.inputs import fresh_receivers, gathered_weights, payload
from ..harness.reference import check_receiver, sync_and_check
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    TopologyError,
    TrainerTopology,
    receiver_shard,
    trainer_groups,
    trainer_shard,
)
from pytest_weightsync.reference_impl.senders.select import Capabilities, NoCompatiblePathError, select_path


# --- the matrix ------------------------------------------------------------------------------


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("path", FORMATS)
def test_path_lands_bit_exact_on_every_rank(moe_case, path):
    sync_and_check(moe_case, path, version=1)


@pytest.mark.weightsync_property("bit_exact")
@given(case=matrix.cases())
@settings(max_examples=15)  # four paths per example
def test_all_paths_agree_on_generated_topologies(case):
    full = gathered_weights(case, version=2)
    for path in FORMATS:
        sync_and_check(case, path, version=2, full=full)


@pytest.mark.weightsync_property("trainer_gather")
def test_trainer_gather_restores_full_weights(moe_case):
    spec = moe_case.spec
    full = synth.full_weights(spec, version=0)
    gathered = gathered_weights(moe_case, version=0)
    for layer in range(spec.num_layers):
        for expert in range(spec.num_experts):
            for projection in ("gate", "up", "down"):
                compare.assert_bitwise_equal(
                    gathered[layer][expert][projection], full[layer][expert][projection],
                    name=f"layer {layer} expert {expert} {projection}_proj")


# --- versions --------------------------------------------------------------------------------


@pytest.mark.weightsync_property("no_stale_values")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in matrix.CASES[:6]])
def test_successive_versions_leave_no_stale_value(case):
    """Four updates into the same buffers, each by a different path and bucket limit: every
    check compares against the new version, which differs from every earlier one in every
    element."""
    receivers = fresh_receivers(case)
    for version, path in enumerate(("compat", "hf_fused", "packed", "direct")):
        sync_and_check(case, path, version, receivers, bucket=BUCKET_LIMITS[version])


def test_versions_differ_in_every_element():
    spec = MoESpec(num_layers=1, num_experts=2, hidden=16, intermediate=12)
    bits = [synth.full_weights(spec, v)[0][1].up.view(torch.int16) for v in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert bool((bits[a] != bits[b]).all()), f"versions {a} and {b} share an element"


def test_synthetic_values_are_finite_and_position_dependent():
    spec = MoESpec(num_layers=2, num_experts=3, hidden=16, intermediate=12)
    full = synth.full_weights(spec, 0, finite=True)
    for layer, experts in full.items():
        for w in experts:
            for projection in ("gate", "up", "down"):
                t = w[projection]
                assert torch.isfinite(t.float()).all()
                assert (t != 0).all()
                # neighbours along each axis differ (almost) everywhere
                assert (t[1:] != t[:-1]).float().mean() > 0.95
                assert (t[:, 1:] != t[:, :-1]).float().mean() > 0.95
    assert not torch.equal(full[0][0].gate, full[0][0].up)
    assert not torch.equal(full[0][0].gate, full[0][1].gate)
    assert not torch.equal(full[0][0].gate, full[1][0].gate)


# --- partial updates -------------------------------------------------------------------------


@pytest.mark.weightsync_property("untouched_outside_payload")
@pytest.mark.parametrize("path", FORMATS)
def test_one_layer_chunk_changes_nothing_else(path):
    case = matrix.ANCHORS[0]
    receivers = sync_and_check(case, "compat", version=0)
    full = gathered_weights(case, version=1)
    for rec in receivers:
        before = compare.snapshot(rec.params)
        rec.load(payload(path, case, rec.rank, layers=[1], full=full),
                 load_format="direct" if path == "direct" else None)
        touched = [n for n in rec.params if n.startswith("model.layers.1.")]
        compare.assert_unchanged(before, rec.params, exclude=touched, rank=rec.rank)
        expected = synth.expected_receiver_params(case.spec, case.receiver, rec.rank, 1)
        for name in touched:
            compare.assert_bitwise_equal(rec.params[name], expected[name], name=name)


def test_compat_payload_of_only_local_experts_is_enough():
    case = matrix.ANCHORS[0]
    full = gathered_weights(case, version=3)
    for rec in fresh_receivers(case):
        from pytest_weightsync.reference_impl.senders import compat

        rec.load(compat.export(full, experts=rec.shard.experts))
        check_receiver(rec, case, version=3)


# --- the layout model ------------------------------------------------------------------------


@given(case=matrix.cases())
@settings(max_examples=25)
def test_receiver_ranks_of_one_replica_cover_every_element_once(case):
    spec, topo = case.spec, case.receiver
    for dp_rank in range(topo.moe_dp):
        count = torch.zeros(spec.num_experts, spec.intermediate, dtype=torch.int32)
        for rank in range(topo.tp):
            shard = receiver_shard(spec, topo, rank)
            if shard.moe_dp_rank != dp_rank:
                continue
            assert shard.buffer_rows >= shard.rows >= 0
            count[shard.experts.start:shard.experts.stop,
                  shard.row_start:shard.row_start + shard.rows] += 1
        assert bool((count == 1).all()), f"DP replica {dp_rank}: coverage {count.unique()}"


@given(case=matrix.cases())
@settings(max_examples=25)
def test_trainer_ranks_of_one_replica_cover_every_element_once(case):
    spec, topo = case.spec, case.trainer
    count = torch.zeros(spec.num_layers, spec.num_experts, spec.intermediate, dtype=torch.int32)
    for rank in range(topo.world_size):
        s = trainer_shard(spec, topo, rank)
        if s.edp_rank == 0:
            count[s.layers.start:s.layers.stop, s.experts.start:s.experts.stop,
                  s.row_start:s.row_start + s.rows] += 1
    assert bool((count == 1).all())
    for kind, size in (("etp", topo.etp), ("ep", topo.ep), ("pp", topo.pp)):
        groups = trainer_groups(spec, topo, kind)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))


def test_receiver_rank_math_matches_sglang_formula():
    topo = ReceiverTopology(tp=8, moe_ep=2, moe_dp=2)  # moe_tp = 2
    spec = MoESpec(num_layers=1, num_experts=4, hidden=4, intermediate=8)
    got = [(s.moe_tp_rank, s.moe_ep_rank) for s in (receiver_shard(spec, topo, r) for r in range(8))]
    assert got == [(r % 2, (r // 2) % 2) for r in range(8)]
    assert receiver_shard(spec, topo, 3).experts == range(2, 4)
    assert receiver_shard(spec, topo, 3).row_start == 4


@pytest.mark.parametrize("build, constraint", [
    (lambda: receiver_shard(MoESpec(1, 6, 4, 8), ReceiverTopology(tp=4, moe_ep=4), 0),
     "num_experts must be divisible by the receiver's moe_ep"),
    (lambda: trainer_shard(MoESpec(1, 6, 4, 8), TrainerTopology(ep=4), 0),
     "num_experts must be divisible by the trainer's expert parallel size"),
    (lambda: trainer_shard(MoESpec(1, 4, 4, 7), TrainerTopology(etp=2), 0),
     "intermediate must be divisible by the trainer's expert tensor parallel size"),
    (lambda: receiver_shard(MoESpec(1, 4, 4, 6), ReceiverTopology(tp=4), 0),
     "intermediate must be divisible by the receiver's moe_tp"),
    (lambda: ReceiverTopology(tp=4, moe_ep=8),
     "receiver tp must be divisible by moe_ep * moe_dp"),
    (lambda: TrainerTopology(tp=2, ep=4, dp=1),
     "ranks per pipeline stage (tp * dp) must be divisible by etp * ep"),
    (lambda: trainer_shard(MoESpec(3, 4, 4, 8), TrainerTopology(pp=2), 0),
     "num_layers must be divisible by the trainer's pipeline parallel size"),
    (lambda: receiver_shard(MoESpec(1, 4, 4, 8), ReceiverTopology(tp=2, intermediate_padded=3), 0),
     "intermediate_padded must be >= intermediate // moe_tp"),
    (lambda: receiver_shard(MoESpec(1, 4, 4, 9),
                            ReceiverTopology(tp=4, intermediate_padded=2, pad_mode="blocked"), 0),
     "blocked padding needs intermediate_padded * moe_tp >= intermediate"),
    (lambda: MoESpec(1, 0, 4, 8), "MoESpec.num_experts must be an int >= 1"),
])
def test_impossible_topology_is_refused_by_name(build, constraint):
    with pytest.raises(TopologyError) as info:
        build()
    assert constraint in str(info.value)
    assert "got" in str(info.value)  # the offending values are shown


# --- path selection --------------------------------------------------------------------------


def test_select_path_falls_back_with_a_reason():
    padded = ReceiverTopology(tp=2, order="up_gate", intermediate_padded=8)
    choice = select_path("direct", Capabilities(padded=False), padded)
    assert choice.path == "packed" and choice.fell_back
    assert "padded" in str(choice)
    # hf_fused is gate-first whatever the receiver order: an order gap stops at it
    choice = select_path("direct", Capabilities(orders=frozenset({"gate_up"})), padded)
    assert choice.path == "hf_fused"
    assert [p for p, _ in choice.skipped] == ["direct", "packed"]
    assert "'up_gate'" in choice.skipped[1][1]
    choice = select_path("direct", Capabilities(formats=frozenset({"direct", "packed", "compat"}),
                                                orders=frozenset({"gate_up"})), padded)
    assert choice.path == "compat"
    assert [p for p, _ in choice.skipped] == ["direct", "packed", "hf_fused"]
    choice = select_path("packed", Capabilities(), padded)
    assert choice.path == "packed" and not choice.fell_back
    choice = select_path("direct", Capabilities(formats=frozenset({"compat", "direct"})),
                         ReceiverTopology(tp=2))
    assert choice.path == "direct"
    with pytest.raises(NoCompatiblePathError, match="does not accept the compat format"):
        select_path("packed", Capabilities(formats=frozenset({"direct"})), ReceiverTopology())


@pytest.mark.parametrize("path", FORMATS)
def test_selected_path_is_bit_exact(path):
    """Whatever path selection picks, the result is the same bits."""
    case = matrix.ANCHORS[2]
    caps = Capabilities(formats=frozenset({"packed", "compat"}))
    choice = select_path(path, caps, case.receiver)
    assert choice.path in ("packed", "compat")
    sync_and_check(case, choice.path, version=5)


def test_trainer_state_missing_a_shard_is_named():
    case = matrix.ANCHORS[1]  # tp2 etp2: both ranks hold half of every expert
    states = trainer.trainer_states(case.spec, case.trainer, synth.full_weights(case.spec, 0))
    name = "decoder.layers.1.mlp.experts.linear_fc2.weight0"
    del states[1][name]
    with pytest.raises(trainer.TrainerStateError, match=f"trainer rank 1 has no parameter '{name}'"):
        trainer.gather_full_weights(case.spec, case.trainer, states)


def test_trainer_shards_that_leave_an_expert_uncovered_are_named(monkeypatch):
    # the gather writes into fresh grouped buffers: an (layer, expert) no ETP group read would
    # keep whatever memory held, so a topology that misses one is an error, not a result
    case = matrix.ANCHORS[1]
    states = trainer.trainer_states(case.spec, case.trainer, synth.full_weights(case.spec, 0))
    groups = trainer.trainer_groups
    # every ETP group loses its last rank: half of every expert's rows are never read
    monkeypatch.setattr(trainer, "trainer_groups", lambda *a: [g[:-1] for g in groups(*a)])
    with pytest.raises(trainer.TrainerStateError, match=r"do not cover \(layer, expert\)"):
        trainer.gather_full_weights(case.spec, case.trainer, states)
