"""Expert weight sync across real ``torch.distributed`` ranks (gloo on CPU).

Each rank is a trainer rank holding only its own Megatron shards (the full weights are
deleted after slicing) and gathers what the sender needs over its ETP, EP and PP process
groups; the same process is also a receiver rank (colocated) that loads only its own payload.
Successive versions go through the same receiver buffers, each in another format, as a
bucket stream cut at another limit. Every rank checks its parameters
bit for bit against the independently computed expected state.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology

#: (world size, trainer topology, receiver topology): receiver rank = world rank % receiver tp,
#: so a receiver tp smaller than the world means several engines (one per group of ranks).
MULTIRANK_CASES = [
    pytest.param(2, TrainerTopology(ep=2), ReceiverTopology(tp=2, moe_ep=2), id="w2-ep2-to-ep2"),
    pytest.param(2, TrainerTopology(tp=2, etp=2), ReceiverTopology(tp=2, order="up_gate"),
                 id="w2-etp2-to-moetp2-upgate"),
    pytest.param(4, TrainerTopology(tp=2, ep=2, etp=2), ReceiverTopology(tp=4, moe_ep=2),
                 id="w4-ep2etp2-to-moetp2ep2"),
    pytest.param(4, TrainerTopology(ep=2, pp=2, expert_impl="te_grouped"),
                 ReceiverTopology(tp=2, moe_ep=1, intermediate_padded=7),
                 id="w4-pp2ep2te-to-2engines-tp2-padded"),
    pytest.param(4, TrainerTopology(tp=2, etp=2, pp=2), ReceiverTopology(tp=4, moe_ep=4),
                 id="w4-etp2-ep1-pp2-to-ep4"),
]

SPEC = MoESpec(num_layers=2, num_experts=4, hidden=10, intermediate=12)


def _sync_in_ranks(trainer_topo, receiver_topo, versions=(0, 1, 2)):
    """Body run in every rank: gather from own shards, load own payload, check; per version."""
    import torch.distributed as dist

    from pytest_weightsync.vocabulary import BUCKET_LIMITS, FORMATS, LOAD_FORMAT

    from ..harness.cases import Case
    from ..harness.inputs import locator, stream
    from pytest_weightsync import compare
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer
    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

    rank = dist.get_rank()
    case = Case(SPEC, trainer_topo, receiver_topo)
    receiver = ReferenceReceiver(SPEC, receiver_topo, rank % receiver_topo.tp)
    with trainer.TrainerGroups.create(SPEC, trainer_topo) as groups:
        for tensor in receiver.params.values():
            synth.poison_(tensor)
        for version in versions:
            full = synth.full_weights(SPEC, version)
            state = trainer.trainer_state(SPEC, trainer_topo, rank, full)
            del full  # the trainer rank keeps only its shards
            gathered = trainer.gather_full_weights_dist(SPEC, trainer_topo, state, groups)
            # every version a different format and bucket limit (as a bucket stream)
            path = FORMATS[(version + 3) % len(FORMATS)]
            limit = BUCKET_LIMITS[(version + 1) % len(BUCKET_LIMITS)]
            before = compare.snapshot(receiver.params)
            receiver.begin_update()
            for bucket in stream(path, case, receiver.rank, bucket=limit, full=gathered):
                receiver.load(bucket, load_format=LOAD_FORMAT[path])
            receiver.end_update()
            expected = synth.expected_receiver_params(SPEC, receiver_topo, receiver.rank, version)
            compare.assert_loaded(receiver.params, expected, before=before,
                                  locate=locator(case, receiver.rank),
                                  rank=receiver.rank)
    return receiver.rank


@pytest.mark.weightsync_property("bit_exact_multirank")
@pytest.mark.parametrize("world, trainer_topo, receiver_topo", MULTIRANK_CASES)
def test_gathered_sync_is_bit_exact_in_real_ranks(rank_pool, world, trainer_topo, receiver_topo):
    assert trainer_topo.world_size == world
    receiver_ranks = rank_pool.run(_sync_in_ranks, world, trainer_topo, receiver_topo)
    assert receiver_ranks == [r % receiver_topo.tp for r in range(world)]


@pytest.mark.weightsync_property("bit_exact_multirank")
@pytest.mark.ranks(4)
def test_marker_form_runs_body_in_four_ranks():
    import torch.distributed as dist

    assert dist.get_world_size() == 4
    _sync_in_ranks(TrainerTopology(tp=4, ep=4), ReceiverTopology(tp=4, moe_ep=2), versions=(7,))


def _naive_etp_concat_in_ranks():
    """All-gathers fc1 shards and concatenates them as-is (the known bug): the gate half then
    holds ``[gate_0; up_0]`` and the comparison must locate the damage."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync import compare
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer

    topo = TrainerTopology(tp=2, etp=2)
    spec = MoESpec(num_layers=1, num_experts=1, hidden=4, intermediate=4)
    full = synth.full_weights(spec, 0)
    state = trainer.trainer_state(spec, topo, dist.get_rank(), full)
    fc1 = next(t for n, t in state.items() if "linear_fc1" in n)
    shards = [torch.empty_like(fc1) for _ in range(2)]
    dist.all_gather(shards, fc1)
    naive_gate = torch.cat(shards)[:spec.intermediate]
    try:
        compare.assert_bitwise_equal(naive_gate, full[0][0].gate, name="gate_proj")
    except compare.BitMismatchError as exc:
        return str(exc)
    return None


def test_naive_etp_concat_is_detected_in_real_ranks(rank_pool):
    messages = rank_pool.run(_naive_etp_concat_in_ranks, 2)
    assert all(m is not None and "gate_proj[2, 0]" in m for m in messages), messages
