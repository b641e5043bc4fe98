"""A layer that declares its grouped buffers (``GroupedExperts``) is exported by slicing them.

A stateless sender exports every update; proving block by block that 768 per-expert views lie
at fixed steps in one storage cost 0.7-1.7 ms of host time per layer. A layer built as
:class:`GroupedExperts` (the oracle's grouped trainer, the reference gather) is sliced
instead. These tests hold that path to the block-by-block one: the same payload (names,
shapes, bits, and the same trainer memory wherever the block path finds a view) for every
format, MoE-TP, EP, padding and gate/up order; no per-block proof on the way; and no trust in
buffers the experts no longer lie in.
"""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.errors import WeightSyncError  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import (  # noqa: E402
    GroupedExperts,
    MoESpec,
    ReceiverTopology,
    grouped_buffers,
)
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.senders import formats as senders, zerocopy  # noqa: E402

SPEC = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=8)
TOPOLOGIES = {
    "tp1": ReceiverTopology(tp=1),
    "tp2": ReceiverTopology(tp=2),
    "tp2-up_gate": ReceiverTopology(tp=2, order="up_gate"),
    "ep2": ReceiverTopology(tp=2, moe_ep=2),
    "tp2-padded": ReceiverTopology(tp=2, intermediate_padded=8),
}


def bits(t):
    return t.contiguous().view(torch.int16)


def plain(full):
    """The same views as a plain tuple per layer: the block-by-block path."""
    return {layer: tuple(experts) for layer, experts in full.items()}


def same_payload(got, want):
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(bits(g), bits(w)), f"{name}: other bits"
        if w.untyped_storage().data_ptr() != g.untyped_storage().data_ptr():
            continue  # both staged (fresh memory each)
        assert (g.data_ptr(), g.stride()) == (w.data_ptr(), w.stride()), f"{name}: another view"


@pytest.mark.parametrize("fmt", senders.FORMATS)
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
def test_a_grouped_layer_exports_what_the_block_path_exports_without_proving_blocks(
        fmt, topo, monkeypatch):
    topology = TOPOLOGIES[topo]
    full = synth.grouped_full_weights(SPEC, 3)
    want = [senders.export(fmt, SPEC, topology, r, plain(full)) for r in range(topology.world_size)]

    def no_proof(*args, **kwargs):
        raise AssertionError("a grouped layer was proven block by block")

    monkeypatch.setattr(zerocopy, "grid_view", no_proof)
    for rank in range(topology.world_size):
        same_payload(senders.export(fmt, SPEC, topology, rank, full), want[rank])


def test_a_grouped_layer_at_a_view_path_sends_the_trainer_memory_itself():
    full = synth.grouped_full_weights(SPEC, 1)
    fc1, fc2 = grouped_buffers(full[0])
    (_, w13), (_, w2) = senders.export("direct", SPEC, TOPOLOGIES["tp1"], 0, full, [0])
    assert w13.data_ptr() == fc1.data_ptr() and w2.data_ptr() == fc2.data_ptr()
    (_, w13), (_, w2) = senders.export("direct", SPEC, TOPOLOGIES["tp2"], 1, full, [0])
    # MoE-TP 2: the fc2 columns are a strided view; [gate_r; up_r] is staged
    assert w2.data_ptr() == fc2.data_ptr() + (SPEC.intermediate // 2) * fc2.element_size()
    assert w13.untyped_storage().data_ptr() != fc1.untyped_storage().data_ptr()


def test_buffers_are_trusted_only_while_the_experts_lie_in_them():
    full = synth.grouped_full_weights(SPEC, 2)
    layer = full[0]
    fc1, fc2 = grouped_buffers(layer)
    assert grouped_buffers(layer, torch.float16) is None, "another dtype"
    assert grouped_buffers(layer, device="meta") is None, "another device"
    assert grouped_buffers(tuple(layer)) is None, "a plain tuple declares nothing"
    want = senders.export("packed", SPEC, TOPOLOGIES["tp1"], 0, plain(full), [0])
    fc1.set_(fc1.clone())  # the buffer moves; the experts' views stay where they were
    assert layer.buffers() is None
    got = senders.export("packed", SPEC, TOPOLOGIES["tp1"], 0, full, [0])
    same_payload(got, want)  # the block path: the experts' own memory
    assert got[0][1].data_ptr() == layer[0].gate.data_ptr()


def test_memory_moved_into_shared_memory_keeps_the_layer_grouped():
    full = synth.grouped_full_weights(SPEC, 2)
    layer = full[1]
    layer[0].gate.share_memory_()  # what sharing over CPU IPC does to the trainer's storage
    assert grouped_buffers(layer) is not None


def test_a_grouped_layer_pickles_as_its_buffers():
    full = synth.grouped_full_weights(SPEC, 4)
    again = pickle.loads(pickle.dumps(full[1]))
    assert isinstance(again, GroupedExperts) and grouped_buffers(again) is not None
    assert len(again) == SPEC.num_experts
    for a, b in zip(again, full[1]):
        for projection in ("gate", "up", "down"):
            assert torch.equal(bits(a[projection]), bits(b[projection]))


@pytest.mark.parametrize("fc1, fc2", [
    (torch.zeros(4, 8), torch.zeros(4, 8, 4)),  # fc1 2-D
    (torch.zeros(4, 7, 8), torch.zeros(4, 8, 3)),  # odd fc1 rows
    (torch.zeros(4, 8, 8), torch.zeros(4, 8, 8)),  # fc2 not [E, H, I]
    (torch.zeros(4, 8, 8), torch.zeros(4, 8, 4, dtype=torch.float16)),  # dtypes differ
    (torch.zeros(4, 8, 16)[:, :, ::2], torch.zeros(4, 8, 4)),  # fc1 not contiguous
    ("fc1", torch.zeros(4, 8, 4)),  # not a tensor
], ids=["fc1-2d", "odd-rows", "fc2-shape", "dtype", "strided", "not-a-tensor"])
def test_grouped_experts_refuse_buffers_that_are_not_a_grouped_layer(fc1, fc2):
    with pytest.raises(WeightSyncError):
        GroupedExperts(fc1, fc2)


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 3, 4, 5], [0, 2, 4], [3, 1], [5]], ids=str)
def test_expert_grids_of_any_slots_are_the_blocks_of_those_slots(slots):
    """Consecutive slots are sliced out of the buffers; others go block by block, which finds
    fixed non-negative steps (``[0, 2, 4]``) and nothing else (``[3, 1]``: no view)."""
    layer = synth.grouped_full_weights(SPEC, 5)[0]
    for halves in (("gate", "up"), ("up", "gate")):
        joined, parts, down = zerocopy.expert_grids(layer, slots, halves, SPEC.dtype)
        if slots == [3, 1]:
            assert (joined, parts, down) == (None, None, None)
            continue
        for k, slot in enumerate(slots):
            assert torch.equal(bits(parts[0][k]), bits(layer[slot][halves[0]]))
            assert torch.equal(bits(parts[1][k]), bits(layer[slot][halves[1]]))
            assert torch.equal(bits(down[k]), bits(layer[slot].down))
            if joined is not None:
                assert torch.equal(bits(joined[k, 0]), bits(layer[slot][halves[0]]))
                assert torch.equal(bits(joined[k, 1]), bits(layer[slot][halves[1]]))


@pytest.mark.parametrize("experts", [1, 2, 5])
def test_a_layer_of_any_number_of_experts_is_grouped(experts):
    fc1 = torch.arange(experts * 8 * 3, dtype=torch.float32).view(experts, 8, 3)
    fc2 = torch.zeros(experts, 3, 4)
    layer = GroupedExperts(fc1, fc2)
    found = grouped_buffers(layer)
    assert found is not None and found[0] is fc1 and found[1] is fc2
    assert torch.equal(layer[-1].up, fc1[-1, 4:]) and torch.equal(layer[0].gate, fc1[0, :4])
