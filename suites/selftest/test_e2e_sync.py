"""The reference sync end to end at the hardware limit: zero-copy payloads, payloads shared once
per model, the receiver's plan cache, and the colocated driver, checked bit for bit.

CPU: the pieces and the whole trainer -> engine path through shared memory (real spawned
engine processes, tiny model). GPU (``@pytest.mark.gpu``): the same path over CUDA IPC, with
the plan cache's CUDA graphs. The expected values always come from the synthetic oracle
(``synth`` evaluated at the layout's coordinates), never from what a sender produced.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.engine import process as engine_process  # noqa: E402
from pytest_weightsync.reference_impl.sharing import ipc  # noqa: E402
from pytest_weightsync.reference_impl.senders import formats as senders  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.senders.colocated import (  # noqa: E402
    ColocatedSender,
    ColocatedSync,
    StagingBudgetError,
)
from pytest_weightsync.reference_impl.model.layout import (  # noqa: E402
    EtpGroupedExperts,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    hf_expert_name,
)
from pytest_weightsync.reference_impl.oracle.oracle_check import first_mismatch  # noqa: E402
from pytest_weightsync.reference_impl.engine.receiver import (  # noqa: E402
    DuplicateEntryError,
    PayloadDtypeError,
    ReferenceReceiver,
)
from pytest_weightsync.reference_impl.sharing.shared_payload import (  # noqa: E402
    SharedPayload,
    SharedPayloadError,
)
from pytest_weightsync.reference_impl.kernels.strided_blocks import grid_view  # noqa: E402
from pytest_weightsync.reference_impl.senders.zerocopy import as_shape  # noqa: E402

SPEC = MoESpec(num_layers=3, num_experts=4, hidden=32, intermediate=16)
FORMATS = ("direct", "packed", "hf_fused", "compat")
LOAD_FORMAT = {"direct": "direct", "packed": None, "hf_fused": None, "compat": None}
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def xor_weights(full, mask: int) -> None:
    """Every trainer element becomes ``bits ^ mask`` (in place, storages unchanged)."""
    signed = mask - 0x10000 if mask >= 0x8000 else mask
    done = set()
    for layer in full.values():
        tensors = (layer.buffers() if isinstance(layer, EtpGroupedExperts)
                   else [t for w in layer for t in (w.gate, w.up, w.down)])
        for t in tensors:
            if id(t) not in done:
                t.view(torch.int16).bitwise_xor_(signed)
                done.add(id(t))


def poisoned(spec, topo, rank, device="cpu", plan_cache=True):
    receiver = ReferenceReceiver(spec, topo, rank, device, plan_cache=plan_cache)
    for t in receiver.params.values():
        synth.poison_(t)
    return receiver


def one_update(receiver, payload, load_format):
    receiver.begin_update()
    plan = receiver.load(payload, load_format)
    receiver.end_update()
    return plan


# --------------------------------------------------------------------------------------------
# The trainer layout and zero-copy payloads
# --------------------------------------------------------------------------------------------


def test_grouped_weights_and_batched_blocks_hold_the_oracle_bits():
    spec = MoESpec(num_layers=2, num_experts=5, hidden=16, intermediate=8)
    per_expert, grouped = synth.full_weights(spec, 3), synth.grouped_full_weights(spec, 3)
    for layer in per_expert:
        fc1 = grouped[layer][0].gate.untyped_storage()
        for e in range(spec.num_experts):
            assert grouped[layer][e].up.untyped_storage().data_ptr() == fc1.data_ptr()
            for p in ("gate", "up", "down"):
                assert torch.equal(bits(per_expert[layer][e][p]), bits(grouped[layer][e][p])), (layer, e, p)
    rows, cols = torch.arange(3, 8), torch.arange(16)
    batch = synth.expert_blocks(spec, 2, 1, [4, 0, 2], "up", rows, cols)
    for i, e in enumerate([4, 0, 2]):
        assert torch.equal(bits(batch[i]), bits(synth.expert_block(spec, 2, 1, e, "up", rows, cols)))


@pytest.mark.parametrize("fmt, topo", [("packed", ReceiverTopology()), ("hf_fused", ReceiverTopology()),
                                       ("direct", ReceiverTopology())])
def test_exporters_send_views_of_grouped_trainer_memory(fmt, topo):
    full = synth.grouped_full_weights(SPEC, 1)
    storages = {w.gate.untyped_storage().data_ptr() for layer in full.values() for w in layer}
    storages |= {w.down.untyped_storage().data_ptr() for layer in full.values() for w in layer}
    staged = senders.export(fmt, SPEC, topo, 0, synth.full_weights(SPEC, 1))
    shared = senders.export(fmt, SPEC, topo, 0, full)
    for (name, a), (other, b) in zip(staged, shared):
        assert name == other and torch.equal(bits(a), bits(b)), name
        assert a.untyped_storage().data_ptr() not in storages
        assert b.untyped_storage().data_ptr() in storages, f"{name} was staged"
    receiver = poisoned(SPEC, topo, 0, plan_cache=False)
    for layer in range(SPEC.num_layers):
        receiver.load(senders.export(fmt, SPEC, topo, 0, full, [layer]), LOAD_FORMAT[fmt])
    assert first_mismatch(receiver.params, SPEC, topo, 0, 1) is None


@pytest.mark.parametrize("fmt, topo", [("packed", ReceiverTopology(order="up_gate")),
                                       ("direct", ReceiverTopology(tp=2)),
                                       ("direct", ReceiverTopology(tp=2, intermediate_padded=12))])
def test_exporters_stage_where_the_trainer_layout_is_not_the_payloads(fmt, topo):
    full = synth.grouped_full_weights(SPEC, 2)
    trainer = {w.gate.untyped_storage().data_ptr() for layer in full.values() for w in layer}
    for rank in range(topo.world_size):
        entries, pairs = senders.layer_payload(fmt, SPEC, topo, rank, full, 0)
        assert pairs and all(t.untyped_storage().data_ptr() not in trainer for _, t in entries)
    receivers = [poisoned(SPEC, topo, r, plan_cache=False) for r in range(topo.world_size)]
    for receiver in receivers:
        one_update(receiver, senders.export(fmt, SPEC, topo, receiver.rank, full), LOAD_FORMAT[fmt])
        assert first_mismatch(receiver.params, SPEC, topo, receiver.rank, 2) is None


def tiled_view(blocks, shape, dtype, device=None):
    """What a sender sends for ``blocks`` landing back to back in a tensor of ``shape``: the
    view the blocks already are, or ``None`` (then it stages)."""
    grid = grid_view(blocks, (len(blocks),), dtype, device)
    return as_shape(grid, (len(blocks), *blocks[0].shape), shape, contiguous=True)


def test_tiled_view_refuses_every_layout_that_is_not_exactly_the_payloads():
    buf = torch.arange(64, dtype=torch.int16).view(torch.bfloat16)
    a, b, c = buf[0:16].view(4, 4), buf[16:32].view(4, 4), buf[32:48].view(4, 4)
    view = tiled_view([a, b, c], (3, 4, 4), torch.bfloat16)
    assert view is not None and view.data_ptr() == a.data_ptr()
    assert torch.equal(bits(view), bits(buf[:48]).view(3, 4, 4))
    other = buf[16:32].clone().view(4, 4)
    assert tiled_view([a, c, b], (3, 4, 4), torch.bfloat16) is None, "order"
    assert tiled_view([a, c], (2, 4, 4), torch.bfloat16) is None, "gap"
    assert tiled_view([a, other], (2, 4, 4), torch.bfloat16) is None, "another storage"
    assert tiled_view([a, b], (3, 4, 4), torch.bfloat16) is None, "fewer elements"
    assert tiled_view([a.t(), b], (2, 4, 4), torch.bfloat16) is None, "non-contiguous"
    assert tiled_view([a, b], (2, 4, 4), torch.float16) is None, "dtype"
    assert tiled_view([a, b], (2, 4, 4), torch.bfloat16, device="meta") is None, "device"
    z = torch.zeros(8, dtype=torch.complex64)
    assert tiled_view([z[:4].conj(), z[4:].conj()], (8,), torch.complex64) is None, "lazy conjugate"


def test_grid_view_is_the_blocks_at_fixed_steps_or_nothing():
    from pytest_weightsync.reference_impl.kernels.strided_blocks import grid_view

    buf = torch.arange(96, dtype=torch.int16).view(torch.bfloat16).view(4, 2, 3, 4)  # [E, 2, r, H]
    blocks = [buf[e, h] for e in range(4) for h in range(2)]
    view = grid_view(blocks, (4, 2), torch.bfloat16)
    assert view is not None and view.data_ptr() == buf.data_ptr()
    assert torch.equal(bits(view), bits(buf))
    rows = grid_view([buf[e, h, 1:] for e in range(4) for h in range(2)], (4, 2), torch.bfloat16)
    assert rows is not None and torch.equal(bits(rows), bits(buf[:, :, 1:])), "strided blocks"
    cols = grid_view([buf[e, 0, :, 1:3] for e in (1, 2, 3)], (3,), torch.bfloat16)
    assert cols is not None and torch.equal(bits(cols), bits(buf[1:, 0, :, 1:3]))
    assert grid_view(blocks, (2, 4), torch.bfloat16) is not None, "another grid of one layout"
    assert grid_view(blocks[::-1], (4, 2), torch.bfloat16) is None, "negative steps"
    assert grid_view(blocks[:3] + blocks[4:], (7,), torch.bfloat16) is None, "a gap"
    assert grid_view(blocks[:1] * 2, (2,), torch.bfloat16) is None, "one block twice"
    assert grid_view(blocks, (3, 2), torch.bfloat16) is None, "the grid's count"
    copy = [b.clone() if i == 5 else b for i, b in enumerate(blocks)]
    assert grid_view(copy, (4, 2), torch.bfloat16) is None, "another storage"
    assert grid_view([buf[0, 0], buf[0, 1, :2]], (2,), torch.bfloat16) is None, "shapes"
    assert grid_view([buf[0, 0], buf[0, 1].t().t()], (2,), torch.bfloat16) is not None
    assert grid_view(blocks, (4, 2), torch.float16) is None, "dtype"
    assert grid_view(blocks, (4, 2), torch.bfloat16, device="meta") is None, "device"
    assert grid_view([buf[0, 0].to_sparse()], (1,), torch.bfloat16) is None, "sparse"
    z = torch.zeros(8, dtype=torch.complex64)
    assert grid_view([z[:4].conj(), z[4:].conj()], (2,), torch.complex64) is None, "lazy conjugate"
    assert grid_view([], (0,), torch.bfloat16) is None


@pytest.mark.parametrize("fmt", ["packed", "hf_fused"])
@pytest.mark.parametrize("topo", [ReceiverTopology(), ReceiverTopology(tp=2),
                                  ReceiverTopology(tp=2, intermediate_padded=12),
                                  ReceiverTopology(order="up_gate"), ReceiverTopology(tp=2, moe_ep=2)],
                         ids=["tp1", "tp2", "tp2-padded", "up_gate", "ep2"])
def test_a_fresh_all_expert_tensor_is_planned_in_a_few_pairs(fmt, topo):
    """The reference receiver plans an all-expert tensor for its slots at once (a whole pair
    or a strided pair per half), not a pair per expert; a subclass that places experts its own
    way keeps the per-expert path. Both land the oracle's bits."""
    full = synth.grouped_full_weights(SPEC, 3)

    class OwnPlacement(ReferenceReceiver):
        def _write_w2(self, plan, layer, slot, full):
            super()._write_w2(plan, layer, slot, full)

    for rank in range(topo.world_size):
        payload = senders.export(fmt, SPEC, topo, rank, full)
        fast = poisoned(SPEC, topo, rank, plan_cache=False)
        per_expert = OwnPlacement(SPEC, topo, rank, "cpu", plan_cache=False)
        local = len(fast.shard.experts) * SPEC.num_layers
        assert len(fast.plan(payload, None).pairs) <= 3 * SPEC.num_layers
        assert len(per_expert.plan(payload, None).pairs) == 3 * local
        for receiver in (fast, per_expert):
            one_update(receiver, payload, None)
            assert first_mismatch(receiver.params, SPEC, topo, rank, 3) is None


# --------------------------------------------------------------------------------------------
# Payloads shared once
# --------------------------------------------------------------------------------------------


def test_shared_payload_is_one_handle_per_storage_and_rebuilds_every_tensor():
    full = synth.grouped_full_weights(SPEC, 4)
    payload = senders.export("compat", SPEC, ReceiverTopology(), 0, full)
    shared = SharedPayload(payload)
    assert shared.entries == len(payload) == SPEC.num_layers * SPEC.num_experts * 3
    assert shared.storages == 2 * SPEC.num_layers  # fc1 and fc2 of each layer
    received = ipc.deserialize(shared.serialize())
    assert len(received) == len(payload)
    for (name, t), (other, r) in zip(payload, received):
        assert name == other and r.shape == t.shape and r.stride() == t.stride()
        assert torch.equal(bits(r), bits(t)), name
    again = ipc.deserialize(shared.serialize())  # the first one still holds the mappings
    assert again.cache_key() == received.cache_key()
    with pytest.raises(SharedPayloadError, match="requires grad"):
        SharedPayload([("x", torch.zeros(2, requires_grad=True))])
    with pytest.raises(SharedPayloadError, match="not a \\(name, tensor\\) pair"):
        SharedPayload([("x", [1, 2])])


def test_shared_payload_keys_differ_by_shape_stride_dtype_and_address():
    base = torch.zeros(64, dtype=torch.bfloat16)
    key = lambda entries: ipc.deserialize(SharedPayload(entries).serialize()).cache_key()  # noqa: E731
    k = key([("a", base[:32].view(4, 8))])
    assert k == key([("a", base[:32].view(4, 8))])
    assert k != key([("a", base[:32].view(8, 4))]), "shape"
    assert k != key([("a", base[:32].view(8, 4).t())]), "strides"
    assert k != key([("a", base[:32].view(torch.float16).view(4, 8))]), "dtype"
    assert k != key([("a", base[32:].view(4, 8))]), "offset"
    assert k != key([("a", base.clone()[:32].view(4, 8))]), "storage"


# --------------------------------------------------------------------------------------------
# The receiver's plan cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_cache_replays_a_known_bucket_with_new_values_and_replans_a_changed_one(fmt):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 0)
    receiver = poisoned(SPEC, topo, 1)
    payload = senders.export(fmt, SPEC, topo, 1, full)
    one_update(receiver, payload, LOAD_FORMAT[fmt])
    assert receiver.plan_cache.stats.last == "miss"
    current = 0
    for mask in (0x1111, 0x2222):  # same tensors, new values: a hit, and the new bits land
        xor_weights(full, current ^ mask)
        current = mask
        if fmt == "direct":  # direct at MoE-TP 2 is staged: refill the same staging tensors
            fresh = senders.export(fmt, SPEC, topo, 1, full)
            for (_, t), (_, f) in zip(payload, fresh):
                t.copy_(f)
        one_update(receiver, payload, LOAD_FORMAT[fmt])
        assert receiver.plan_cache.stats.last == "hit"
        assert first_mismatch(receiver.params, SPEC, topo, 1, 0, xor=mask) is None
    moved = [(name, t.clone()) for name, t in payload]  # same names, other addresses
    xor_weights(full, 0x2222 ^ 0x3333)
    for (_, m), fresh in zip(moved, senders.export(fmt, SPEC, topo, 1, full)):
        m.copy_(fresh[1])
    one_update(receiver, moved, LOAD_FORMAT[fmt])
    assert receiver.plan_cache.stats.last == "replan" and len(receiver.plan_cache) == 1
    assert first_mismatch(receiver.params, SPEC, topo, 1, 0, xor=0x3333) is None


def test_plan_cache_replans_when_strides_change_or_a_parameter_is_replaced():
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 5)
    receiver = poisoned(SPEC, topo, 0)
    payload = senders.export("compat", SPEC, topo, 0, full)
    one_update(receiver, payload, None)
    one_update(receiver, payload, None)
    assert receiver.plan_cache.stats.last == "hit"
    # the same values, gate_proj sent column-major: same names and shapes, other strides
    strided = [(n, t.t().contiguous().t() if n.endswith("gate_proj.weight") else t) for n, t in payload]
    one_update(receiver, strided, None)
    assert receiver.plan_cache.stats.last == "replan"
    assert first_mismatch(receiver.params, SPEC, topo, 0, 5) is None
    name = fused_name(1, "w13")
    old = receiver.params[name]
    receiver.params[name] = synth.poison_(torch.empty_like(old))  # the engine reallocated it
    before = old.clone()
    one_update(receiver, strided, None)
    assert receiver.plan_cache.stats.last == "replan"
    assert torch.equal(bits(old), bits(before)), "the cached plan wrote into the old parameter"
    assert first_mismatch(receiver.params, SPEC, topo, 0, 5) is None


def test_plan_cache_keeps_validation_before_writing_and_duplicates_across_the_update():
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 6)
    receiver = poisoned(SPEC, topo, 0)
    shared = SharedPayload(senders.export("packed", SPEC, topo, 0, full, [0]))
    first = ipc.deserialize(shared.serialize())
    receiver.load(first, None)
    receiver.load(first, None)
    assert receiver.plan_cache.stats.last == "hit"
    snapshot = {n: t.clone() for n, t in receiver.params.items()}
    bad = [(n, t.float()) for n, t in senders.export("packed", SPEC, topo, 0, full, [1])]
    with pytest.raises(PayloadDtypeError, match="dtype torch.float32"):
        receiver.load(bad, None)
    receiver.begin_update()
    receiver.load(first, None)  # a hit
    with pytest.raises(DuplicateEntryError, match="layer 0 expert 0 gate_proj was already carried"):
        receiver.load(first, None)  # the same bucket again in one update: refused, not replayed
    assert all(torch.equal(bits(t), bits(snapshot[n])) for n, t in receiver.params.items())
    assert len(receiver.plan_cache) == 1


def test_plan_cache_recognises_a_shared_payload_without_rebuilding_its_tensors():
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 7)
    receiver = poisoned(SPEC, topo, 0)
    shared = SharedPayload(senders.export("compat", SPEC, topo, 0, full))
    kept = ipc.deserialize(shared.serialize())
    one_update(receiver, kept, None)
    later = ipc.deserialize(shared.serialize())
    one_update(receiver, later, None)
    assert receiver.plan_cache.stats.last == "hit" and later._items is None
    assert first_mismatch(receiver.params, SPEC, topo, 0, 7) is None


# --------------------------------------------------------------------------------------------
# The sender built once per model
# --------------------------------------------------------------------------------------------


def test_colocated_sender_views_when_it_can_and_buckets_staging_within_its_budget():
    full = synth.grouped_full_weights(SPEC, 8)
    for fmt in ("packed", "hf_fused", "compat"):
        assert ColocatedSender(fmt, SPEC, ReceiverTopology(tp=2), full).staged_bytes == 0
    assert ColocatedSender("direct", SPEC, ReceiverTopology(), full).staged_bytes == 0
    # Both ranks' [gate_r; up_r] rows are staged; their fc2 columns are strided views.
    layer = 2 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    arena = lambda s, b: s.buckets[b].entries[0][0][1].untyped_storage().data_ptr()  # noqa: E731
    one = ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full, staging_bytes=layer + 4096)
    assert [b.layers for b in one.buckets] == [[0], [1], [2]]
    assert one.staged_bytes == SPEC.num_layers * layer
    w2 = dict(one.payload(0, 1))[fused_name(0, "w2")]
    assert not w2.is_contiguous() and w2.untyped_storage().data_ptr() in {
        w.down.untyped_storage().data_ptr() for w in full[0]}, "fc2 columns: a view"
    assert arena(one, 0) == arena(one, 1), "a layer does not fit half the budget: one arena"
    whole = ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full, staging_bytes=3 * layer)
    assert [b.layers for b in whole.buckets] == [[0, 1, 2]], "exactly the budget: one bucket"
    two = ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full, staging_bytes=2 * layer + 100)
    assert [b.layers for b in two.buckets] == [[0], [1], [2]]
    assert [b.arena for b in two.buckets] == [0, 1, 0]
    assert arena(two, 0) == arena(two, 2) != arena(two, 1), "two arenas, alternating"
    with pytest.raises(StagingBudgetError, match="layer 0 needs"):
        ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full, staging_bytes=layer // 2)


# --------------------------------------------------------------------------------------------
# End to end through engine processes (shared memory on CPU)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_engines():
    engines = [engine_process.ReceiverProcess("cpu", timeout=120), engine_process.ReceiverProcess("cpu", timeout=120)]
    for engine in engines:
        engine.start()
    yield engines
    for engine in engines:
        engine.close()
    assert all(engine.pid is None for engine in engines)


def run_sync(engines, fmt, topo, full, masks, staging_bytes=None):
    sync = ColocatedSync(ColocatedSender(fmt, SPEC, topo, full, staging_bytes=staging_bytes), engines)
    sync.register()
    caches = []
    for mask in masks:
        xor_weights(full, mask)
        timing = sync.update()
        caches.append(timing.cache)
        assert timing.wall >= timing.export and set(timing.ranks) == set(range(topo.world_size))
    return sync, caches


@pytest.mark.parametrize("fmt", FORMATS)
def test_colocated_sync_through_engine_processes_is_exact_and_replays_its_plans(cpu_engines, fmt):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 9)
    ptrs = [e.configure(SPEC, topo, r) for r, e in enumerate(cpu_engines)]
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    sync, caches = run_sync(cpu_engines, fmt, topo, full, (0x0101, 0x0101 ^ 0x0202, 0x0202 ^ 0x0303),
                            staging_bytes=2 * layer + 100)  # direct: two buckets, two arenas
    assert_replayed_and_exact(sync, caches, cpu_engines, seed=9, mask=0x0303)
    report = cpu_engines[0].update_registered(sync.registrations[0][:1], sync.sender.load_format,
                                              begin=False, end=False)
    assert dict(report.param_ptrs) == ptrs[0]
    close_all(sync, cpu_engines)


@pytest.mark.parametrize("fmt, per_update", [("direct", False), ("direct", True),
                                             ("packed", True)])
def test_a_sender_per_trainer_rank_feeds_only_its_own_engine_rank(cpu_engines, fmt, per_update):
    # colocated: each GPU's trainer rank sends its own engine rank, nothing for the others
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 13)
    for r, engine in enumerate(cpu_engines):
        engine.configure(SPEC, topo, r)
    syncs = []
    for rank in (1, 0):
        sender = ColocatedSender(fmt, SPEC, topo, full, receivers=[rank])
        assert sender.receivers == (rank,)
        assert all(list(b.shared) == [rank if fmt == "direct" else 0] for b in sender.buckets)
        syncs.append(ColocatedSync(sender, [cpu_engines[rank]], per_update=per_update))
    mask = 0
    for new in (0x0111, 0x0222):
        xor_weights(full, mask ^ new)
        mask = new
        for sync in syncs:
            timing = sync.update()
            assert len(timing.ranks) == 1
    assert [e.check(13, 0, mask) for e in cpu_engines] == [None, None]
    with pytest.raises(WeightSyncError, match=r"feeds receiver rank\(s\) \[1\], not 0"):
        syncs[0].sender.serialize(0, 0)
    syncs[1].close()
    close_all(syncs[0], cpu_engines)


def test_a_sender_refuses_receivers_outside_its_topology_before_building_anything(cpu_engines):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 13)
    for bad in ([2], [], [0, 0], [True], [-1], "0", 1):
        with pytest.raises(WeightSyncError, match="receivers must be distinct receiver ranks"):
            ColocatedSender("direct", SPEC, topo, full, receivers=bad)
    sender = ColocatedSender("direct", SPEC, topo, full, receivers=(1,))
    with pytest.raises(WeightSyncError, match=r"2 engine process\(es\) for a sender that feeds 1"):
        ColocatedSync(sender, cpu_engines)


def assert_replayed_and_exact(sync, caches, engines, *, seed, mask) -> None:
    """Three updates: every bucket of every rank planned on the first, replayed on the next
    two; every engine holds the oracle's bits (``seed``) xor ``mask``."""
    buckets = len(sync.sender.buckets) * sync.sender.topo.world_size
    assert caches == [["miss"] * buckets, ["hit"] * buckets, ["hit"] * buckets]
    assert [e.check(seed, 0, mask) for e in engines] == [None] * len(engines)


def close_all(sync, engines) -> None:
    sync.close()
    for engine in engines:
        engine.reset()


def test_engine_check_names_the_first_element_an_update_missed(cpu_engines):
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 10)
    cpu_engines[0].configure(SPEC, topo, 0)
    sync, _ = run_sync(cpu_engines[:1], "packed", topo, full, (0x0404,))
    xor_weights(full, 0x0404 ^ 0x0505)  # the trainer moved on; the engine was not updated
    problem = cpu_engines[0].check(10, 0, 0x0505)
    assert problem is not None and "model.layers.0.mlp.experts.w13_weight[0, 0, 0]" in problem
    assert "layer=0 expert=0 projection=gate row=0 col=0" in problem
    sync.close()
    cpu_engines[0].reset()


def test_per_update_wire_format_hits_the_cache_when_payloads_are_views(cpu_engines):
    """SGLang's format re-shared every update: validated every time, copy plan reused."""
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 11)
    cpu_engines[0].configure(SPEC, topo, 0)
    payload = senders.export("packed", SPEC, topo, 0, full)
    caches = [cpu_engines[0].update(ipc.serialize(payload), None).cache for _ in range(3)]
    assert caches == [("miss",), ("hit",), ("hit",)]
    assert cpu_engines[0].check(11) is None
    name = hf_expert_name(0, 0, "gate")
    with pytest.raises(engine_process.ReceiverProcessError, match="dtype torch.float32"):
        cpu_engines[0].update(ipc.serialize([(name, full[0][0].gate.float())]), None)
    assert cpu_engines[0].check(11) is None, "a refused bucket wrote something"


def test_end_to_end_benchmark_runs_and_checks_its_bits_on_cpu(cpu_engines):
    if not BENCH.exists():
        pytest.skip("benchmarks/bench_e2e.py is not in this installation (a repository file)")
    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    part = bench.ExpertsPart(SPEC, torch.device("cpu"))
    topo = ReceiverTopology(tp=2)
    ptrs = [e.configure(SPEC, topo, r) for r, e in enumerate(cpu_engines)]
    args = bench.main.__globals__["argparse"].Namespace(
        formats=["direct", "compat"], staging_mib=1, repeats=3, warmup=2, progress=None)
    failures = []
    rows = bench.registered_rows(part, cpu_engines, topo, 2, args, bench.Masks(),
                                 bench.PlainCopy(part.written_bytes(topo), "cpu", 1 << 20), ptrs, failures)
    assert failures == [] and [r["bits"] for r in rows] == ["exact", "exact"]
    assert all(r["cache_hits"] == 3 * r["buckets"] * 2 and r["cache_other"] == 0 for r in rows), rows
    assert all(0 < r["ratio"] and r["wall_s"] >= r["export_s"] for r in rows)


# --------------------------------------------------------------------------------------------
# GPU: the same path over CUDA IPC
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, tp", [("direct", 1), ("packed", 2), ("compat", 1), ("direct", 2)])
def test_gpu_colocated_sync_over_cuda_ipc_is_exact_and_replays_cuda_graphs(fmt, tp):
    # packed at MoE-TP 2 with the engine ranks in turn; staged direct there side by side
    gpu_sync_rounds(fmt, tp, seed=12, steps=4, ranks_in_turn=fmt == "packed",
                    check_sender=lambda sender: (sender.staged_bytes == 0) == (fmt != "direct"
                                                                               or tp == 1))


@pytest.mark.gpu
@pytest.mark.parametrize("per_update", [False, True], ids=["registered", "per_update"])
def test_gpu_direct_from_etp_shards_stages_nothing_and_is_exact(per_update):
    # the trainer's ETP 2 shards are the engine ranks' w13 / w2 at MoE-TP 2: views, one copy
    gpu_sync_rounds("direct", 2, seed=14, steps=3, per_update=per_update, etp=2,
                    check_sender=lambda sender: sender.staged_bytes == 0)


def gpu_sync_rounds(fmt, tp, *, seed, steps, per_update=False, bucket_layers=False,
                    check_sender=None, after_update=None, ranks_in_turn=False, etp=None):
    """Updates of 3 small layers over CUDA IPC into ``tp`` engine processes on GPU 0: the
    trainer's bits xor-ed in place before each, every bucket a plan-cache miss on the first
    update and a hit after, parameters never moved, the oracle's bits after the last.
    ``per_update``: SGLang's protocol (serialized every update) instead of registered
    payloads; ``bucket_layers``: one layer per bucket; ``after_update(engines, full, step)``;
    ``ranks_in_turn``: every bucket to rank 0, then every bucket to rank 1; ``etp``:
    the trainer holds ETP shards of that size (direct only), not one gathered buffer."""
    spec = MoESpec(num_layers=3, num_experts=16, hidden=256, intermediate=128)
    topo = ReceiverTopology(tp=tp)
    full = (synth.grouped_full_weights(spec, seed, device="cuda") if etp is None
            else synth.etp_grouped_weights(spec, seed, etp=etp, device="cuda"))
    engines = [engine_process.ReceiverProcess("cuda:0", timeout=120) for _ in range(tp)]
    try:
        ptrs = [e.configure(spec, topo, r) for r, e in enumerate(engines)]
        layer = 3 * spec.num_experts * spec.intermediate * spec.hidden * 2
        sender = ColocatedSender(fmt, spec, topo, full, staging_bytes=2 * layer,
                                 bucket_bytes=layer if bucket_layers else None)
        if check_sender is not None:
            assert check_sender(sender)
        sync = ColocatedSync(sender, engines, per_update=per_update,
                             ranks_in_turn=ranks_in_turn)
        assert sync.ranks_in_turn == (ranks_in_turn and tp > 1)
        if not per_update:
            sync.register()
        mask = 0
        for step in range(steps):
            new = 0x1357 * (step + 1) & 0x7FFF
            xor_weights(full, mask ^ new)
            torch.cuda.synchronize()
            mask = new
            timing = sync.update(memory=True)
            want = "miss" if step == 0 else "hit"
            assert timing.cache == [want] * len(sender.buckets) * tp, timing.cache
            for reports in timing.reports:
                for report in reports:
                    assert dict(report.param_ptrs) == ptrs[report.rank]
            if after_update is not None:
                after_update(engines, full, step)
        assert [e.check(seed, 0, mask) for e in engines] == [None] * tp
        sync.close()
    finally:
        for engine in engines:
            engine.close()
