"""Planted bugs in the layout model, the value function, the senders and the trainer gather are
killed by the suites' own checks - with a located message.

Each mutant replaces one real function (or constant) of the reference with a realistic wrong
version, everywhere it is bound (``from layout import receiver_shard`` copies included), then
runs an unchanged suite check:

- ``conformance``: the expert-sync check (``harness.sync_and_check``: every receiver rank, two
  versions, every path), judged against ``synth.expected_receiver_params``;
- ``oracle``: the layout-oracle suite's independent expected state
  (``test_layout_oracle._oracle``: SGLang's ownership rules restated as plain slicing, no
  ``layout`` call), located by the same plain arithmetic. A layout mutant that the expected
  state and the receiver share cancels out of ``conformance``; this is the check that sees it.

A mutant counts as killed only when the check raises an ``AssertionError`` (or the project's
``WeightSyncError``) whose message names layer, expert and projection (and row/col where an
element differs).
"""

from __future__ import annotations

import sys

import pytest
import torch

from pytest_weightsync.vocabulary import FORMATS

from ..harness import cases as matrix
from ..harness import inputs
from ..harness import reference as harness
from . import test_expert_sync as expert_suite
from . import test_layout_oracle as oracle_suite
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.senders import compat, direct, hf_fused, packed
from pytest_weightsync.reference_impl.model import layout
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.model.layout import ExpertWeights, WeightSyncError
from pytest_weightsync.reference_impl.model.locate import Location

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: Square 3x3 per-rank blocks, 3 local experts, 4 layers, up/gate, trainer ETP2 EP2 PP2 (TE),
#: receiver MoE-TP2 x MoE-EP2.
SQUARE = matrix.ANCHORS[5]
#: Uneven MoE-TP split with blocked padding.
BLOCKED = matrix.ANCHORS[4]
#: The recipe-like case: trainer TP2 PP2 EP4, receiver EP2.
RECIPE = matrix.ANCHORS[0]
LOCATED = ("layer=", "expert=", "projection=")


#: ``(name, mutant, original)`` of every mutant planted in the running test.
_PLANTED: list = []


def _project_modules():
    return [mod for mod in list(sys.modules.values())
            if mod is not None and getattr(mod, "__name__", "").startswith("pytest_weightsync")]


def plant(monkeypatch, module, name, replacement):
    """Replace ``module.name`` and every other binding of the same object in the project's
    modules (``from module import name`` copies), for this test only."""
    original = getattr(module, name)
    for mod in _project_modules():
        if getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, replacement)
    _PLANTED.append((name, replacement, original))
    return original


@pytest.fixture(autouse=True)
def _no_mutant_outlives_its_test():
    """A module first imported while a mutant was planted bound the mutant itself
    (``from layout import gate_up_halves``), out of monkeypatch's reach: put the original
    back there too, or every later test in this process runs the mutant."""
    yield
    for name, mutant, original in _PLANTED:
        for mod in _project_modules():
            if getattr(mod, name, None) is mutant:
                setattr(mod, name, original)
    _PLANTED.clear()


# --- the two checks ------------------------------------------------------------------------


def conformance(case, paths=FORMATS):
    for path in paths:
        receivers = inputs.fresh_receivers(case)
        for version in (0, 1):
            harness.sync_and_check(case, path, version, receivers)


def _oracle_locate(spec, topo, rank, name, index):
    """Model coordinates of ``name[index]`` by the oracle suite's own ownership arithmetic."""
    experts, start, rows, buffer_rows, gate_off, up_off = oracle_suite._owned(spec, topo, rank)
    layer = int(name.split(".")[2])
    slot, i, j = (int(x) for x in index)
    if name.endswith("w13_weight"):
        projection = "gate" if (i >= gate_off and i < gate_off + buffer_rows) else "up"
        local = i - (gate_off if projection == "gate" else up_off)
        padding = local >= rows
        return Location(layer, experts[slot], projection, None if padding else start + local, j,
                        rank, padding, (slot, i, j))
    padding = j >= rows
    return Location(layer, experts[slot], "down", i, None if padding else start + j, rank,
                    padding, (slot, i, j))


def oracle(case):
    """The layout-oracle suite's check, with its own locator."""
    spec, topo = case.spec, case.receiver
    full = synth.full_weights(spec, oracle_suite.VERSION)
    for receiver in inputs.fresh_receivers(case):
        rank = receiver.rank
        for layer in range(spec.num_layers):
            receiver.load(inputs.payload("compat", case, rank, layers=[layer], full=full))
        want = oracle_suite._oracle(spec, topo, rank, full)
        expected = synth.expected_receiver_params(spec, topo, rank, oracle_suite.VERSION)
        locate = lambda name, index, rank=rank: _oracle_locate(spec, topo, rank, name, index)  # noqa: E731
        for name, tensor in want.items():
            for label, got in (("expected state", expected), ("reference receiver", receiver.params)):
                if name not in got:
                    raise AssertionError(f"{label} of receiver rank {rank} lacks {name}")
                compare.assert_bitwise_equal(got[name], tensor, name=name, locate=locate,
                                             rank=rank)


def killed(check, case, *extra):
    with pytest.raises((AssertionError, WeightSyncError)) as info:
        check(case)
    message = str(info.value)
    for word in (*LOCATED, *extra):
        assert word in message, f"killed, but not located ({word!r} missing):\n{message}"
    return info.value


# --- layout.py -------------------------------------------------------------------------------


def test_gate_up_halves_swapped_is_killed_by_the_oracle(monkeypatch):
    real = layout.gate_up_halves
    plant(monkeypatch, layout, "gate_up_halves", lambda order: tuple(reversed(real(order))))
    conformance(SQUARE, ["compat"])  # expected state and receiver agree: the gap
    killed(oracle, SQUARE, "row=", "col=")


def _shard_patch(monkeypatch, change):
    real = layout.receiver_shard

    def mutated(spec, topo, rank):
        return change(real(spec, topo, rank), spec, topo, rank)

    plant(monkeypatch, layout, "receiver_shard", mutated)


def test_receiver_expert_range_off_by_one_is_killed_by_the_oracle(monkeypatch):
    def off_by_one(shard, spec, topo, rank):
        start = max(0, shard.experts.start - 1)  # "ep_rank * per_rank - 1" on every rank but 0
        return layout.ReceiverShard(**{**shard.__dict__,
                                       "experts": range(start, start + len(shard.experts))})

    _shard_patch(monkeypatch, off_by_one)
    killed(oracle, SQUARE, "row=", "col=")


def test_moe_tp_rank_formula_swapped_is_killed_by_the_oracle(monkeypatch):
    def ep_major(shard, spec, topo, rank):
        tp_rank, ep_rank = (rank // topo.moe_ep) % topo.moe_tp, rank % topo.moe_ep
        per = spec.num_experts // topo.moe_ep
        return layout.ReceiverShard(**{**shard.__dict__, "moe_tp_rank": tp_rank,
                                       "moe_ep_rank": ep_rank,
                                       "experts": range(ep_rank * per, (ep_rank + 1) * per),
                                       "row_start": shard.rows * tp_rank})

    _shard_patch(monkeypatch, ep_major)
    killed(oracle, SQUARE, "row=", "col=")


def _uneven_patch(monkeypatch, rule):
    """Planted in the one layout home: vLLM's uneven EP map (``linear_uneven``) computed by
    ``rule(E, EP, ep_rank, right experts) -> experts``; every other placement unchanged."""
    def uneven(shard, spec, topo, rank):
        if topo.expert_placement != "linear_uneven":
            return shard
        experts = rule(spec.num_experts, topo.moe_ep, shard.moe_ep_rank, shard.experts)
        return layout.ReceiverShard(**{**shard.__dict__, "experts": experts})

    _shard_patch(monkeypatch, uneven)


def test_uneven_ep_offset_as_if_even_is_killed_by_the_oracle(monkeypatch):
    # EP rank e starts at e * E // EP (7 over 4: rank 1 at expert 1, vLLM's map at 2)
    _uneven_patch(monkeypatch, lambda num, ep, r, right: range(r * num // ep,
                                                               r * num // ep + len(right)))
    case = matrix.UNEVEN_EP_CASES[1]
    conformance(case, ["compat"])  # expected state and receiver agree: the gap
    killed(oracle, case, "expert=2 ", "receiver_rank=1")


def test_uneven_ep_remainder_on_the_last_rank_is_killed_by_the_oracle(monkeypatch):
    # E // EP experts per rank, the remainder on the last: 5 over 2 gives rank 0 two, not three
    _uneven_patch(monkeypatch, lambda num, ep, r, right: range(
        r * (num // ep), (r + 1) * (num // ep) + (num % ep if r == ep - 1 else 0)))
    case = matrix.UNEVEN_EP_CASES[0]
    conformance(case, ["compat"])
    with pytest.raises(AssertionError) as info:
        oracle(case)
    message = str(info.value)
    assert "w13_weight on receiver rank 0: shape (2, 8, 8), expected (3, 8, 8)" in message, message


def test_blocked_pad_start_wrong_is_killed_by_the_oracle(monkeypatch):
    def even_start(shard, spec, topo, rank):
        if topo.pad_mode != "blocked":
            return shard
        start = min((spec.intermediate // topo.moe_tp) * shard.moe_tp_rank, spec.intermediate)
        rows = min(shard.buffer_rows, spec.intermediate - start)
        return layout.ReceiverShard(**{**shard.__dict__, "row_start": start, "rows": rows})

    _shard_patch(monkeypatch, even_start)
    killed(oracle, BLOCKED, "row=", "col=")


# --- synth.py --------------------------------------------------------------------------------


def test_version_mask_zero_is_killed_by_the_version_check(monkeypatch):
    monkeypatch.setattr(synth, "version_mask", lambda version: 0)
    with pytest.raises(AssertionError, match=r"versions 0 and 1 share an element"):
        expert_suite.test_versions_differ_in_every_element()


def test_hash_ignoring_projection_is_killed_by_the_value_check(monkeypatch):
    real = synth._scalar_key
    monkeypatch.setattr(synth, "_scalar_key",
                        lambda seed, layer, expert, projection: real(seed, layer, expert, "gate"))
    conformance(SQUARE, ["packed"])  # every sender and the oracle agree: the gap
    with pytest.raises(AssertionError):
        expert_suite.test_synthetic_values_are_finite_and_position_dependent()


# --- senders -----------------------------------------------------------------------------------


def test_packed_sender_ignoring_the_order_is_located(monkeypatch):
    real = packed.export_layer
    monkeypatch.setattr(packed, "export_layer",
                        lambda spec, layer, experts, order, device=None:
                        real(spec, layer, experts, "gate_up", device))
    killed(lambda case: conformance(case, ["packed"]), SQUARE, "row=", "col=")


def test_direct_sender_transposing_a_square_block_is_located(monkeypatch):
    real = direct.export_layer

    def transposed(*args, **kwargs):
        out = real(*args, **kwargs)
        return [(n, t.transpose(-1, -2).contiguous() if n.endswith("w2_weight") else t)
                for n, t in out]

    monkeypatch.setattr(direct, "export_layer", transposed)
    killed(lambda case: conformance(case, ["direct"]), SQUARE, "projection=down", "row=")


def test_direct_sender_taking_rank_0_rows_is_located(monkeypatch):
    def rank0(spec, topo, rank, layer, experts, device=None):
        shard = layout.receiver_shard(spec, topo, rank)
        out = real(spec, topo, rank - shard.moe_tp_rank, layer, experts, device)
        return out

    real = direct.export_layer
    monkeypatch.setattr(direct, "export_layer", rank0)
    killed(lambda case: conformance(case, ["direct"]), SQUARE, "receiver_rank=1", "row=3")


def test_compat_sender_dropping_the_last_expert_is_named(monkeypatch):
    real = compat.export

    def drops_last(full, layers=None, experts=None):
        last = len(next(iter(full.values()))) - 1
        return [(n, t) for n, t in real(full, layers, experts)
                if f".experts.{last}." not in n]

    monkeypatch.setattr(compat, "export", drops_last)
    last = SQUARE.spec.num_experts - 1
    with pytest.raises((AssertionError, WeightSyncError)) as info:
        conformance(SQUARE, ["compat"])
    assert f"expert {last}" in str(info.value) or f"expert={last}" in str(info.value), info.value


def test_hf_fused_sender_putting_up_first_is_located(monkeypatch):
    def up_first(layer, experts, device=None):
        swapped = [ExpertWeights(gate=w.up, up=w.gate, down=w.down) for w in experts]
        return real(layer, swapped, device)

    real = hf_fused.export_layer
    monkeypatch.setattr(hf_fused, "export_layer", up_first)
    killed(lambda case: conformance(case, ["hf_fused"]), SQUARE, "row=", "col=")


def test_packed_sender_transposing_down_is_located(monkeypatch):
    real = packed.export_layer

    def transposed(*args, **kwargs):
        out = real(*args, **kwargs)
        name, w2 = out[1]
        return [out[0], (name, w2.transpose(-1, -2).contiguous())]

    monkeypatch.setattr(packed, "export_layer", transposed)
    square = matrix.ANCHORS[6]  # hidden == intermediate: the whole packed w2 is square per expert
    killed(lambda case: conformance(case, ["packed"]), square, "projection=down")


# --- trainer gather ----------------------------------------------------------------------------


def _gather_with(monkeypatch, remap):
    """The trainer gather with its expert/layer placement changed by ``remap``."""
    real = trainer.gather_full_weights

    def mutated(spec, topo, states):
        full = real(spec, topo, states)
        return remap(spec, topo, full)

    monkeypatch.setattr(trainer, "gather_full_weights", mutated)


def test_gather_ep_offset_wrong_is_located(monkeypatch):
    def ep_offset(spec, topo, full):
        per = spec.num_experts // topo.ep
        # local expert i of EP rank r placed at r * per + (i + 1) % per
        return {layer: tuple(experts[(e // per) * per + (e % per - 1) % per]
                             for e in range(spec.num_experts))
                for layer, experts in full.items()}

    _gather_with(monkeypatch, ep_offset)
    killed(lambda case: conformance(case, ["compat"]), RECIPE, "row=", "col=")


def test_gather_pp_offset_wrong_is_located(monkeypatch):
    def pp_offset(spec, topo, full):
        per = spec.num_layers // topo.pp
        # every stage's layers written at stage 0's offsets: the first stage's layers win
        return {layer: full[layer % per] for layer in full}

    _gather_with(monkeypatch, pp_offset)
    err = killed(lambda case: conformance(case, ["direct"]), RECIPE, "row=", "col=")
    assert "layer=2" in str(err) or "layers.2." in str(err), err


def test_etp_merge_without_split_is_located(monkeypatch):
    def naive(fc1_shards, fc2_shards):
        gate, up = torch.cat(list(fc1_shards), dim=-2).chunk(2, dim=-2)
        return ExpertWeights(gate, up, torch.cat(list(fc2_shards), dim=-1))

    def side_by_side(fc1, row_start, rows, size):  # the shard's rows as one slice of [gate; up]
        return (fc1[..., 2 * row_start:2 * row_start + rows, :],
                fc1[..., 2 * row_start + rows:2 * row_start + 2 * rows, :])

    monkeypatch.setattr(trainer, "merge_etp_shards", naive)
    monkeypatch.setattr(trainer, "fc1_targets", side_by_side)
    killed(lambda case: conformance(case, ["packed"]), SQUARE, "projection=", "row=")


@pytest.mark.parametrize("case", [SQUARE, BLOCKED, RECIPE, matrix.ANCHORS[6],
                                  *matrix.UNEVEN_EP_CASES], ids=lambda case: case.id)
def test_unmutated_reference_passes_both_checks(case):
    """The control: the same checks on the unmutated reference pass, so every kill above is
    the planted bug's."""
    conformance(case)
    oracle(case)
