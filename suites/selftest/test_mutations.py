"""The conformance check catches planted bugs, and says where.

Each mutant is the reference receiver (or sender) with one realistic bug planted by
subclassing or monkeypatching. Running the same check the suites use must fail, with an
``AssertionError`` whose message locates the damage in model terms (layer, expert,
projection, row, col, receiver rank) or names the reallocated parameter. A check that passed
a mutant would be a check that cannot fail.
"""

from __future__ import annotations

import pytest

from ..harness.cases import Case
from ..harness.inputs import fresh_receivers
from ..harness.reference import sync_and_check
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.model.layout import ExpertWeights, MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

CASE = Case(MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=8),
            TrainerTopology(tp=2, ep=2, etp=2),
            ReceiverTopology(tp=4, moe_ep=2, intermediate_padded=5))


class GateUpSwapped(ReferenceReceiver):
    """Writes gate where up belongs and up where gate belongs."""

    def _half_offset(self, projection):
        return super()._half_offset("up" if projection == "gate" else "gate")


class ExpertMapShifted(ReferenceReceiver):
    """Global -> local expert map off by one (rotated within the rank's range)."""

    def _local_slot(self, expert):
        slot = super()._local_slot(expert)
        return None if slot is None else (slot + 1) % len(self.shard.experts)


class ExpertOffsetByOne(ReferenceReceiver):
    """Writes expert e into the slot of expert e + 1 (an offset off by one): the rank's last
    expert falls off the end, its first slot is never written."""

    def _local_slot(self, expert):
        slot = super()._local_slot(expert)
        return None if slot is None or slot + 1 >= len(self.shard.experts) else slot + 1


class WrongTPSlice(ReferenceReceiver):
    """Every MoE-TP rank takes rank 0's rows."""

    def _tp_rows(self, loaded, dim):
        return loaded.narrow(dim, 0, self.shard.rows)


class Reallocates(ReferenceReceiver):
    """Right values, but into fresh tensors: CUDA graphs and IPC handles would go stale."""

    def _apply(self, plan):
        super()._apply(plan)
        self.params = {name: t.clone() for name, t in self.params.items()}


class SkipsLastExpert(ReferenceReceiver):
    """Never writes the last local expert (an off-by-one loop bound)."""

    def _write_w13(self, plan, layer, slot, projection, full):
        if slot != len(self.shard.experts) - 1:
            super()._write_w13(plan, layer, slot, projection, full)

    def _write_w2(self, plan, layer, slot, full):
        if slot != len(self.shard.experts) - 1:
            super()._write_w2(plan, layer, slot, full)


class ForgetsPadding(ReferenceReceiver):
    """Copies the real rows but leaves the padded tail as it was."""

    def _apply(self, plan):
        plan.zero.clear()
        super()._apply(plan)


def _run_mutant(receiver_cls, path):
    """The suites' check on every rank, two versions; returns the failure it raised."""
    receivers = fresh_receivers(CASE, receiver_cls)
    with pytest.raises(AssertionError) as info:
        for version in (0, 1):
            sync_and_check(CASE, path, version, receivers)
    return info.value


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_gate_up_swap_is_located(path):
    err = _run_mutant(GateUpSwapped, path)
    assert isinstance(err.mismatch, compare.BitMismatchError)
    assert "layer=0 expert=0 projection=gate row=0 col=0 receiver_rank=0" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_shifted_expert_map_is_located(path):
    err = _run_mutant(ExpertMapShifted, path)
    assert isinstance(err.mismatch, compare.BitMismatchError)
    assert err.location.expert == 0 and err.location.rank == 0
    assert "expert=0 projection=gate" in str(err) and "receiver_rank=0" in str(err)
    assert str(err).startswith("expert offset shifted by one within the rank (local slot s "
                               "holds local expert s-1 modulo its 2 experts)"), str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_expert_offset_off_by_one_is_named_a_shift(path):
    err = _run_mutant(ExpertOffsetByOne, path)
    first = str(err).splitlines()[0]
    assert first.startswith("expert offset shifted by one (expert e holds expert e-1's values, "
                            "e.g. expert 1; expert(s) 0 never written)"), str(err)
    assert "permutation" not in first
    assert "layer=0 expert=0 projection=gate row=0 col=0 receiver_rank=0" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_wrong_tp_slice_is_located_on_the_second_tp_rank(path):
    err = _run_mutant(WrongTPSlice, path)
    assert isinstance(err.mismatch, compare.BitMismatchError)
    # rank 0 is correct by accident (its slice *is* rank 0's); rank 1 owns rows 4..7
    assert "receiver rank 1" in str(err)
    assert "projection=gate row=4 col=0 receiver_rank=1" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed", "direct"])
def test_reallocated_parameter_is_named(path):
    err = _run_mutant(Reallocates, path)
    assert isinstance(err, compare.StorageChangedError)
    assert "model.layers.0.mlp.experts.w13_weight on receiver rank 0 was reallocated" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_skipped_expert_is_located(path):
    err = _run_mutant(SkipsLastExpert, path)
    assert isinstance(err.mismatch, compare.BitMismatchError)
    assert err.location.expert == 1  # rank 0 owns experts 0..1
    assert "layer=0 expert=1 projection=gate row=0 col=0 receiver_rank=0" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
@pytest.mark.parametrize("path", ["compat", "packed"])
def test_unzeroed_padding_is_located(path):
    err = _run_mutant(ForgetsPadding, path)
    assert isinstance(err.mismatch, compare.BitMismatchError)
    assert err.location.padding
    assert "row=None col=0 (zero padding) receiver_rank=0" in str(err)
    assert "expected 0.0" in str(err)


@pytest.mark.weightsync_property("mutation_detected")
def test_etp_shards_concatenated_without_split_is_located(monkeypatch):
    """The trainer-side bug: fc1 ETP shards ``[gate_r; up_r]`` concatenated as they are."""

    def naive_merge(fc1_shards, fc2_shards):
        import torch

        fc1 = torch.cat(list(fc1_shards), dim=-2)
        gate, up = fc1.chunk(2, dim=-2)
        return ExpertWeights(gate, up, torch.cat(list(fc2_shards), dim=-1))

    def side_by_side(fc1, row_start, rows, size):  # the shard's rows as one slice of [gate; up]
        return (fc1[..., 2 * row_start:2 * row_start + rows, :],
                fc1[..., 2 * row_start + rows:2 * row_start + 2 * rows, :])

    monkeypatch.setattr(trainer, "merge_etp_shards", naive_merge)  # the gather of the ranks
    monkeypatch.setattr(trainer, "fc1_targets", side_by_side)  # the gather of their state dicts
    err = _run_mutant(ReferenceReceiver, "direct")
    assert isinstance(err.mismatch, compare.BitMismatchError)
    # naive: [g0; u0; g1; u1] halved -> gate = [g0; u0] (rows 0..3 right by accident), up =
    # [g1; u1]: receiver rank 0's up rows 0..3 (w13 rows 5..8 after 5 padded gate rows) wrong.
    assert "layer=0 expert=0 projection=up row=0 col=0 receiver_rank=0" in str(err)
    assert "w13_weight[0, 5, 0]" in str(err)


def test_unmutated_reference_passes_the_same_check():
    """The control: the same runs with the reference itself pass."""
    for path in ("compat", "packed", "direct"):
        receivers = fresh_receivers(CASE)
        for version in (0, 1):
            sync_and_check(CASE, path, version, receivers)


# --- the comparison itself -------------------------------------------------------------------


def test_comparison_is_on_raw_bits_not_values():
    import torch

    zeros = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(compare.BitMismatchError, match=r"1 of 3 elements differ.*bits 0x8000"):
        compare.assert_bitwise_equal(torch.tensor([0.0, -0.0, 0.0], dtype=torch.bfloat16), zeros)
    nan = torch.full((2,), float("nan"))
    compare.assert_bitwise_equal(nan, nan.clone())  # same NaN bits are equal; == would say no
    with pytest.raises(compare.MetadataMismatchError, match="dtype torch.float32, expected"):
        compare.assert_bitwise_equal(zeros.float(), zeros)
    with pytest.raises(compare.MetadataMismatchError, match=r"shape \(2,\), expected \(3,\)"):
        compare.assert_bitwise_equal(zeros[:2], zeros)


def test_comparison_without_a_locator_shows_the_raw_index():
    import torch

    a = torch.zeros(2, 3, 4, dtype=torch.float32)
    b = a.clone()
    b[1, 2, 3] = 1.0
    with pytest.raises(compare.BitMismatchError, match=r"w\[1, 2, 3\] on receiver rank 5") as info:
        compare.assert_bitwise_equal(a, b, name="w", rank=5)
    assert info.value.count == 1 and info.value.index == (1, 2, 3)
    assert isinstance(info.value, AssertionError)


def test_snapshot_detects_added_and_changed_parameters():
    import torch

    params = {"a": torch.zeros(4), "b": torch.ones(4)}
    before = compare.snapshot(params)
    params["b"][2] = 5.0
    with pytest.raises(compare.BitMismatchError, match=r"b\[2\]"):
        compare.assert_unchanged(before, params)
    compare.assert_unchanged(before, params, exclude=["b"])
    params["c"] = torch.zeros(1)
    with pytest.raises(compare.StorageChangedError, match=r"added \['c'\]"):
        compare.assert_same_storage(before, params)


def test_reallocation_is_caught_even_when_the_allocator_reuses_the_address():
    import torch

    params = {"w": torch.zeros(64, 64)}
    before = compare.snapshot(params)
    params["w"] = torch.zeros(64, 64)  # the old tensor's last reference is the snapshot's
    with pytest.raises(compare.StorageChangedError, match="w was reallocated"):
        compare.assert_same_storage(before, params)
