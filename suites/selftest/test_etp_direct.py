"""Direct from a trainer's ETP shards, not gathered (``EtpGroupedExperts``).

SGLang's ``load_format="direct"`` takes each engine rank's ``w13`` whole, ``[gate_r; up_r]``
rows of every local expert. Out of a gathered ``[gate; up]`` buffer those rows are two blocks,
so a sender stages them (every fc1 byte copied twice). A Megatron ETP rank's own fc1 already
is that tensor when the trainer's ETP size equals the engine's MoE-TP, so the payload is a
view of it. These tests hold the shard path to the gathered one: the same payload (names,
shapes, bits) for every ETP size against every MoE-TP, EP, padding and gate/up order; views
of the matching shard and nothing staged where ETP == MoE-TP; the receiver's parameters exact
after a registered colocated sync; and a clear refusal of everything else.
"""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver  # noqa: E402
from pytest_weightsync.reference_impl.errors import WeightSyncError  # noqa: E402
from pytest_weightsync.reference_impl.kernels import fastcopy  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import (  # noqa: E402
    EtpGroupedExperts,
    MoESpec,
    ReceiverTopology,
)
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.senders import formats as senders  # noqa: E402
from pytest_weightsync.reference_impl.senders.colocated import ColocatedSender  # noqa: E402
from pytest_weightsync.reference_impl.senders.formats import PayloadFormatError  # noqa: E402

SPEC = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=8)
TOPOLOGIES = {
    "tp1": ReceiverTopology(tp=1),
    "tp2": ReceiverTopology(tp=2),
    "tp4": ReceiverTopology(tp=4),
    "tp8": ReceiverTopology(tp=8),
    "tp2-up_gate": ReceiverTopology(tp=2, order="up_gate"),
    "ep2": ReceiverTopology(tp=4, moe_ep=2),
    "ep4": ReceiverTopology(tp=4, moe_ep=4),
    "tp2-padded": ReceiverTopology(tp=2, intermediate_padded=5),
    "tp2-blocked": ReceiverTopology(tp=2, intermediate_padded=6, pad_mode="blocked"),
}


def bits(t):
    return t.contiguous().view(torch.int16)


def shard_storages(layer: EtpGroupedExperts) -> set:
    return {t.untyped_storage().data_ptr() for t in layer.buffers()}


@pytest.mark.parametrize("etp", [1, 2, 4, 8])
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
def test_direct_from_etp_shards_is_the_gathered_payload(etp, topo):
    topo = TOPOLOGIES[topo]
    gathered = synth.grouped_full_weights(SPEC, 3)
    sharded = synth.etp_grouped_weights(SPEC, 3, etp=etp)
    for rank in range(topo.world_size):
        want = senders.export("direct", SPEC, topo, rank, gathered, [1])
        got = senders.export("direct", SPEC, topo, rank, sharded, [1])
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, g), (_, w) in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert torch.equal(bits(g), bits(w)), f"ETP {etp}, rank {rank}, {name}: other bits"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_etp_equal_to_moe_tp_sends_each_rank_its_own_shard_as_a_view(tp):
    topo = ReceiverTopology(tp=tp)
    sharded = synth.etp_grouped_weights(SPEC, 5, etp=tp)
    for rank in range(tp):
        entries, pairs = senders.layer_payload("direct", SPEC, topo, rank, sharded, 0)
        assert pairs == [], "nothing is staged when the rows are one ETP rank's"
        fc1, fc2 = sharded[0].shard(rank)
        (_, w13), (_, w2) = entries
        assert (w13.data_ptr(), w13.shape) == (fc1.data_ptr(), fc1.shape)
        assert (w2.data_ptr(), w2.shape) == (fc2.data_ptr(), fc2.shape)
    sender = ColocatedSender("direct", SPEC, topo, sharded)
    assert sender.staged_bytes == 0


@pytest.mark.parametrize("etp, topo", [(2, "tp2-up_gate"), (2, "tp4"), (4, "tp2"), (4, "ep2"),
                                       (2, "tp2-padded")])
def test_a_mismatched_etp_stages_from_the_shards_themselves(etp, topo):
    """Where the rows differ the staging pairs read the shards (live trainer memory, as a
    registered sender's plan replays every update), never a gathered snapshot."""
    topo = TOPOLOGIES[topo]
    sharded = synth.etp_grouped_weights(SPEC, 5, etp=etp)
    live = shard_storages(sharded[0])
    entries, pairs = senders.layer_payload("direct", SPEC, topo, 0, sharded, 0)
    assert pairs and all(src.untyped_storage().data_ptr() in live for _, src in pairs)


@pytest.mark.parametrize("etp, tp", [(2, 2), (2, 4), (4, 2)])
def test_a_registered_sync_from_shards_lands_every_bit_and_follows_in_place_updates(etp, tp):
    topo = ReceiverTopology(tp=tp)
    sharded = synth.etp_grouped_weights(SPEC, 0, etp=etp)
    receivers = [ReferenceReceiver(SPEC, topo, r) for r in range(tp)]
    sender = ColocatedSender("direct", SPEC, topo, sharded)
    for version in (0, 7):
        if version:  # the trainer's step writes its shards in place
            fresh = synth.etp_grouped_weights(SPEC, version, etp=etp)
            for layer in sharded:
                for old, new in zip(sharded[layer].buffers(), fresh[layer].buffers()):
                    old.copy_(new)
        for bucket in sender.buckets:
            fastcopy.copy_pairs(bucket.pairs)
        for rank, receiver in enumerate(receivers):
            receiver.begin_update()
            for bucket in sender.buckets:
                receiver.load(bucket.entries[rank], "direct")
            receiver.end_update()
            want = synth.expected_receiver_params(SPEC, topo, rank, version)
            for name, param in receiver.named_parameters():
                assert torch.equal(bits(param), bits(want[name])), (version, rank, name)


def test_gather_is_the_full_layer_and_a_snapshot():
    sharded = synth.etp_grouped_weights(SPEC, 2, etp=4)
    full = synth.grouped_full_weights(SPEC, 2)
    gathered = sharded[1].gather()
    for got, want in zip(gathered.buffers(), full[1].buffers()):
        assert torch.equal(bits(got), bits(want))
    before = bits(gathered.buffers()[0]).clone()
    sharded[1].shard(0)[0].view(torch.int16).bitwise_xor_(1)
    assert torch.equal(bits(gathered.buffers()[0]), before)


def test_a_sharded_layer_pickles_as_its_shards():
    layer = synth.etp_grouped_weights(SPEC, 1, etp=2)[0]
    again = pickle.loads(pickle.dumps(layer))
    assert isinstance(again, EtpGroupedExperts) and (again.etp, len(again)) == (2, 8)
    for a, b in zip(again.buffers(), layer.buffers()):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("fmt", ["packed", "hf_fused", "compat"])
def test_other_formats_refuse_shards_and_name_the_gather(fmt):
    sharded = synth.etp_grouped_weights(SPEC, 1, etp=2)
    with pytest.raises(PayloadFormatError, match=r"only the direct format.*\.gather\(\)"):
        senders.export(fmt, SPEC, ReceiverTopology(tp=2), 0, sharded)
    with pytest.raises(PayloadFormatError, match="ETP shards"):
        ColocatedSender(fmt, SPEC, ReceiverTopology(tp=2), sharded)
    # layers in a list, not a mapping by layer index, are refused before any is read
    as_list = [sharded[layer] for layer in range(SPEC.num_layers)]
    with pytest.raises(PayloadFormatError, match="mapping of layer index.*got list"):
        senders.export(fmt, SPEC, ReceiverTopology(tp=2), 0, as_list)


def test_shards_of_another_model_are_refused_before_anything_is_written():
    other = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=16)
    sharded = synth.etp_grouped_weights(other, 1, etp=2)
    with pytest.raises(WeightSyncError, match="intermediate 16"):
        senders.export("direct", SPEC, ReceiverTopology(tp=2), 0, sharded)


def _tensors(*shapes, dtype=torch.bfloat16):
    return [torch.zeros(s, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("fc1, fc2", [
    ([], []),
    (_tensors((4, 4, 8)), []),
    (_tensors((4, 4, 8), (4, 4, 8)), _tensors((4, 8, 2))),  # one fc2 short
    (_tensors((4, 3, 8)), _tensors((4, 8, 1))),  # odd fc1 rows
    (_tensors((4, 4, 8), (4, 6, 8)), _tensors((4, 8, 2), (4, 8, 3))),  # uneven ranks
    (_tensors((4, 4, 8)), _tensors((4, 8, 3))),  # fc2 of other rows
    (_tensors((4, 4, 8)), _tensors((4, 8, 2), dtype=torch.float32)),
    ([torch.zeros(4, 8, 4, dtype=torch.bfloat16).transpose(1, 2)], _tensors((4, 8, 2))),
    ([torch.zeros(4, 4, 8).tolist()], _tensors((4, 8, 2))),
])
def test_bad_shards_are_refused(fc1, fc2):
    with pytest.raises(WeightSyncError, match="EtpGroupedExperts"):
        EtpGroupedExperts(fc1, fc2)


@pytest.mark.parametrize("etp", [0, 3, True, 2.0])
def test_an_etp_size_that_cannot_split_the_experts_is_refused(etp):
    with pytest.raises(WeightSyncError, match="etp must be"):
        synth.etp_grouped_weights(SPEC, 0, etp=etp)


def test_split_refuses_what_is_not_an_intact_grouped_layer():
    full = synth.grouped_full_weights(SPEC, 0)
    with pytest.raises(WeightSyncError, match="intact GroupedExperts"):
        EtpGroupedExperts.split(tuple(full[0]), 2)


# --------------------------------------------------------------------------------------------
# The distributed exporter: a rank whose shards are its engine rank's parameters sends them
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer, receiver, local", [
    (dict(ep=2, etp=2, dp=4), dict(tp=4, moe_ep=2), True),   # ETP = MoE-TP, EP = EP
    (dict(tp=2, etp=2, dp=2), dict(tp=2), True),             # EP 1 on both sides
    (dict(ep=4, dp=4), dict(tp=4, moe_ep=4), True),          # MoE-TP 1, EP 4 on both sides
    (dict(ep=2, etp=2, dp=4), dict(tp=4, moe_ep=4), False),  # engine MoE-TP 1
    (dict(ep=2, etp=2, dp=4), dict(tp=4, moe_ep=2, order="up_gate"), False),
    (dict(ep=2, etp=2, dp=4), dict(tp=4, moe_ep=2, intermediate_padded=5), False),
    (dict(ep=2, etp=2, dp=4), dict(tp=4, moe_ep=2, engine_layout="transposed"), False),
    (dict(tp=2, etp=2, pp=2, dp=1), dict(tp=2), False),      # a stage holds half the layers
    (dict(ep=4, dp=4), dict(tp=2, moe_ep=2), False),         # other experts per rank
])
def test_the_distributed_exporter_skips_the_gather_only_where_shards_are_parameters(
        trainer, receiver, local):
    from pytest_weightsync.protocols import colocated_engine_rank
    from pytest_weightsync.reference_impl.model.layout import TrainerTopology
    from pytest_weightsync.reference_impl.senders.distributed_export import (
        local_direct_payload,
        shards_are_engine_params,
    )
    from pytest_weightsync.reference_impl.trainer.trainer import trainer_states

    spec = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=8)
    trainer = TrainerTopology(expert_impl="te_grouped", **trainer)
    receiver = ReceiverTopology(**receiver)
    assert shards_are_engine_params(spec, trainer, receiver) is local
    if not local:
        return
    full = synth.grouped_full_weights(spec, 9)
    for rank, state in enumerate(trainer_states(spec, trainer, full)):
        got = local_direct_payload(spec, state, trainer)
        want = senders.export("direct", spec, receiver, colocated_engine_rank(rank, receiver.tp),
                              full)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, g), (_, w) in zip(got, want):
            assert g.shape == w.shape and torch.equal(bits(g), bits(w)), (rank, name)


def test_a_rank_state_short_of_a_layer_is_refused_before_sending():
    from pytest_weightsync.reference_impl.model.layout import TrainerTopology
    from pytest_weightsync.reference_impl.senders.distributed_export import (
        ModelStateError,
        local_direct_payload,
    )
    from pytest_weightsync.reference_impl.trainer.trainer import trainer_states

    spec = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=8)
    trainer = TrainerTopology(etp=2, dp=2)
    state = trainer_states(spec, trainer, synth.grouped_full_weights(spec, 1))[0]
    short = {name: t for name, t in state.items() if ".layers.1." not in name}
    with pytest.raises(ModelStateError, match="1 layers"):
        local_direct_payload(spec, short, trainer)


def test_the_single_process_exporter_takes_a_matching_rank_alone(monkeypatch):
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation
    from pytest_weightsync.reference_impl.model.layout import TrainerTopology
    from pytest_weightsync.reference_impl.trainer import trainer as trainer_mod

    spec = MoESpec(num_layers=2, num_experts=8, hidden=16, intermediate=8)
    full = synth.grouped_full_weights(spec, 4)
    matching = (TrainerTopology(ep=2, etp=2, dp=4), ReceiverTopology(tp=4, moe_ep=2))
    other = (TrainerTopology(ep=2, etp=2, dp=4), ReceiverTopology(tp=4, moe_ep=4))
    gathers = []
    real = trainer_mod.gather_full_weights
    monkeypatch.setattr(trainer_mod, "gather_full_weights",
                        lambda *a, **k: gathers.append(1) or real(*a, **k))
    impl = ReferenceImplementation()
    for (trainer, receiver), gathered in ((matching, False), (other, True)):
        states = trainer_mod.trainer_states(spec, trainer, full)
        for rank in range(receiver.tp):
            gathers.clear()
            got = impl.export_weights(states, format="direct", spec=spec, trainer=trainer,
                                      receiver=receiver, rank=rank)
            assert bool(gathers) is gathered
            want = senders.export("direct", spec, receiver, rank, full)
            for (name, g), (_, w) in zip(got, want):
                assert g.shape == w.shape and torch.equal(bits(g), bits(w)), (rank, name)
    states = trainer_mod.trainer_states(spec, matching[0], full)
    with pytest.raises(trainer_mod.TrainerStateError, match="expected 4 trainer state dicts"):
        impl.export_weights(states[:2], format="direct", spec=spec, trainer=matching[0],
                            receiver=matching[1], rank=0)


@pytest.mark.parametrize("fmt", ["direct", "packed", "hf_fused", "compat"])
def test_export_reads_layers_given_once_as_an_iterator(fmt):
    # the layers are read by the shard check and by the export: an iterator must serve both
    full = synth.grouped_full_weights(SPEC, 1)
    want = senders.export(fmt, SPEC, ReceiverTopology(tp=2), 0, full, [1])
    got = senders.export(fmt, SPEC, ReceiverTopology(tp=2), 0, full, iter([1]))
    assert [n for n, _ in got] == [n for n, _ in want] and got
