"""SGLang's per-update protocol at the copy limit: every update serialized again (each storage
shared anew, the table pickled once), the engine rebuilding, recognising and loading it.

CPU: the wire (one handle per storage), the plan cache recognising plain lists by their
signature (and everything that must still take the full path), the digest the benchmark checks
after every update, and the whole path through spawned engine processes over shared memory.
GPU (``@pytest.mark.gpu``): the same path over CUDA IPC, the plan cache's CUDA graphs replayed
from the second update on. Expected values come from the synthetic oracle, never from a sender.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.engine import process as engine_process  # noqa: E402
from pytest_weightsync.reference_impl.engine.receiver import (  # noqa: E402
    DuplicateEntryError,
    LazyViewError,
    PayloadDtypeError,
    ReferenceReceiver,
    TensorStorageError,
)
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.oracle.oracle_check import first_mismatch  # noqa: E402
from pytest_weightsync.reference_impl.senders import formats as senders  # noqa: E402
from pytest_weightsync.reference_impl.senders.colocated import ColocatedSender, ColocatedSync  # noqa: E402
from pytest_weightsync.reference_impl.sharing import ipc  # noqa: E402
from pytest_weightsync.reference_impl.sharing.shared_payload import (  # noqa: E402
    ReceivedPayload,
    SharedPayloadError,
    serialize_storages,
)

from .test_e2e_sync import (  # noqa: E402,F401,F811
    FORMATS,
    LOAD_FORMAT,
    SPEC,
    assert_replayed_and_exact,
    close_all,
    cpu_engines,
    gpu_sync_rounds,
    xor_weights,
)



def trainer_digest(full):
    storages = {}
    for layer in full.values():
        for w in layer:
            for t in (w.gate, w.down):
                s = t.untyped_storage()
                storages.setdefault(s.data_ptr(), torch.empty(0, dtype=torch.int16, device=t.device)
                                    .set_(s, 0, (s.nbytes() // 2,), (1,)))
    return engine_process.bits_digest(storages.values())


def poisoned(topo, rank, plan_cache=True):
    receiver = ReferenceReceiver(SPEC, topo, rank, "cpu", plan_cache=plan_cache)
    for t in receiver.params.values():
        synth.poison_(t)
    return receiver


# --------------------------------------------------------------------------------------------
# The wire: one handle per storage
# --------------------------------------------------------------------------------------------


def test_serialize_storages_shares_each_storage_once_and_rebuilds_every_tensor():
    full = synth.grouped_full_weights(SPEC, 1)
    payload = senders.export("compat", SPEC, ReceiverTopology(), 0, full)
    received = ipc.deserialize(serialize_storages(payload))
    assert isinstance(received, ReceivedPayload)
    assert received.entries == len(payload) and len(received.wholes) == 2 * SPEC.num_layers
    for (name, t), (other, r) in zip(payload, received):
        assert name == other and r.shape == t.shape and r.stride() == t.stride()
        assert torch.equal(t.view(torch.int16), r.view(torch.int16)), name
    with pytest.raises(SharedPayloadError, match="requires grad"):
        serialize_storages([("x", torch.zeros(2, requires_grad=True))])
    with pytest.raises(SharedPayloadError, match="not a \\(name, tensor\\) pair"):
        serialize_storages([("x", [1, 2])])


# --------------------------------------------------------------------------------------------
# The plan cache recognises plain lists by their signature
# --------------------------------------------------------------------------------------------


def count_plans(receiver, monkeypatch):
    calls = []
    real = receiver.plan

    def plan(payload, load_format=None):
        calls.append(len(payload))
        return real(payload, load_format)
    monkeypatch.setattr(receiver, "plan", plan)
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_list_seen_before_is_replayed_without_validating_again(fmt, monkeypatch):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 2)
    receiver = poisoned(topo, 1)
    calls = count_plans(receiver, monkeypatch)
    payload = senders.export(fmt, SPEC, topo, 1, full)
    mask = 0
    for step, new in enumerate((0x0111, 0x0222, 0x0333)):
        xor_weights(full, mask ^ new)
        mask = new
        if fmt == "direct":  # staged at MoE-TP 2: the same staging tensors, refilled
            for (_, t), (_, f) in zip(payload, senders.export(fmt, SPEC, topo, 1, full)):
                t.copy_(f)
        receiver.begin_update()
        receiver.load(list(payload), LOAD_FORMAT[fmt])  # a new list of the same tensors
        receiver.end_update()
        assert receiver.plan_cache.stats.last == ("miss" if step == 0 else "hit")
        assert first_mismatch(receiver.params, SPEC, topo, 1, 2, xor=mask) is None
    assert calls == [len(payload)], "validated once, then recognised"


def test_a_list_that_differs_in_anything_a_check_reads_is_validated_in_full(monkeypatch):
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 3)
    receiver = poisoned(topo, 0)
    calls = count_plans(receiver, monkeypatch)
    payload = senders.export("packed", SPEC, topo, 0, full, [0])
    receiver.load(payload, None)
    receiver.load(payload, None)
    assert calls == [2] and receiver.plan_cache.stats.last == "hit"
    snapshot = {n: t.clone() for n, t in receiver.params.items()}
    name, w13 = payload[0]
    with pytest.raises(PayloadDtypeError):  # same names, other dtype
        receiver.load([(name, w13.float()), payload[1]], None)
    with pytest.raises(LazyViewError):  # same names, a lazy negation view of the same memory
        receiver.load([(name, w13._neg_view()), payload[1]], None)
    freed = w13.clone()
    freed.untyped_storage().resize_(0)  # same names and shapes, storage freed
    with pytest.raises(TensorStorageError):
        receiver.load([(name, freed), payload[1]], None)
    assert all(torch.equal(t.view(torch.int16), snapshot[n].view(torch.int16))
               for n, t in receiver.params.items()), "a refusal wrote"
    receiver.begin_update()
    receiver.load(payload, None)  # a hit
    with pytest.raises(DuplicateEntryError, match="already carried"):
        receiver.load(payload, None)  # the same bucket again in one update: the full path names it
    strided = [(name, w13.transpose(1, 2).contiguous().transpose(1, 2)), payload[1]]
    receiver.begin_update()
    receiver.load(strided, None)
    assert receiver.plan_cache.stats.last == "replan"
    plain = poisoned(topo, 0, plan_cache=False)
    plain.load(payload, None)
    for name in ("model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"):
        assert torch.equal(receiver.params[name].view(torch.int16), plain.params[name].view(torch.int16))


def test_a_list_for_another_receiver_over_the_same_parameters_is_planned_again(monkeypatch):
    full = synth.grouped_full_weights(SPEC, 4)
    gate_up = poisoned(ReceiverTopology(), 0)
    payload = senders.export("compat", SPEC, ReceiverTopology(), 0, full)
    gate_up.load(payload, None)
    up_gate = ReferenceReceiver(SPEC, ReceiverTopology(order="up_gate"), 0, "cpu",
                                params=gate_up.params)
    up_gate.plan_cache = gate_up.plan_cache  # one cache per parameter set, as the reference keeps
    calls = count_plans(up_gate, monkeypatch)
    up_gate.load(payload, None)
    assert calls == [len(payload)], "a cached plan of another receiver order was replayed"
    assert first_mismatch(up_gate.params, SPEC, ReceiverTopology(order="up_gate"), 0, 4) is None


def test_buckets_hold_at_most_bucket_bytes_of_payload_per_rank():
    full = synth.grouped_full_weights(SPEC, 8)
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2  # every expert, one layer
    groups = lambda s: [b.layers for b in s.buckets]  # noqa: E731
    assert groups(ColocatedSender("packed", SPEC, ReceiverTopology(), full)) == [[0, 1, 2]]
    two = ColocatedSender("compat", SPEC, ReceiverTopology(tp=2), full, bucket_bytes=2 * layer)
    assert groups(two) == [[0, 1], [2]], "rank-independent: each rank gets every expert"
    local = ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full, bucket_bytes=layer)
    assert groups(local) == [[0, 1], [2]], "direct at MoE-TP 2: half a layer per rank"
    assert groups(ColocatedSender("hf_fused", SPEC, ReceiverTopology(), full, bucket_bytes=0)) == \
        [[0], [1], [2]], "a layer larger than the limit travels alone"
    staged = ColocatedSender("direct", SPEC, ReceiverTopology(tp=2), full,
                             staging_bytes=3 * layer, bucket_bytes=layer // 2)
    # The ranks' [gate_r; up_r] rows are staged (2/3 of a layer); their fc2 columns are views.
    assert groups(staged) == [[0], [1], [2]] and staged.staged_bytes == 3 * layer * 2 // 3
    with pytest.raises(Exception, match="bucket_bytes"):
        ColocatedSender("packed", SPEC, ReceiverTopology(), full, bucket_bytes=-1)


def test_a_bucket_ramp_starts_with_one_layer_and_at_most_doubles_up_to_the_bucket_limit():
    spec = SPEC.__class__(num_layers=7, num_experts=4, hidden=16, intermediate=8)
    full = synth.grouped_full_weights(spec, 2)
    layer = 3 * spec.num_experts * spec.intermediate * spec.hidden * 2
    groups = lambda s: [b.layers for b in s.buckets]  # noqa: E731
    assert groups(ColocatedSender("packed", spec, ReceiverTopology(), full, bucket_ramp=True)) \
        == [[0], [1, 2], [3, 4, 5, 6]]
    # a rank's payload is half a layer at MoE-TP 2: a limit of one layer holds two
    capped = ColocatedSender("direct", spec, ReceiverTopology(tp=2), full, bucket_ramp=True,
                             bucket_bytes=layer)
    assert groups(capped) == [[0], [1, 2], [3, 4], [5, 6]] and capped.buckets[0].staged_bytes
    with pytest.raises(Exception, match="bucket_ramp"):
        ColocatedSender("packed", spec, ReceiverTopology(), full, bucket_ramp="yes")


# --------------------------------------------------------------------------------------------
# The digest checked after every update
# --------------------------------------------------------------------------------------------


def test_bits_digest_is_placement_free_and_sees_a_missed_element():
    a = synth.poison_(torch.empty(64, 32, dtype=torch.bfloat16))
    digest = engine_process.bits_digest([a])
    assert digest == engine_process.bits_digest([a[:10], a[10:].t().contiguous()])
    assert digest == engine_process.bits_digest([a.flip(0)])
    stale = a.clone()
    stale.view(torch.int16)[3, 7] ^= 0x0101
    assert engine_process.bits_digest([stale]) != digest


# --------------------------------------------------------------------------------------------
# End to end through engine processes (shared memory on CPU)
# --------------------------------------------------------------------------------------------


def per_update(engines, fmt, topo, full, masks, staging_bytes=None, bucket_bytes=None,
               bucket_ramp=False, serialize_ahead=True):
    sync = ColocatedSync(ColocatedSender(fmt, SPEC, topo, full, staging_bytes=staging_bytes,
                                         bucket_bytes=bucket_bytes, bucket_ramp=bucket_ramp),
                         engines, per_update=True, serialize_ahead=serialize_ahead)
    assert sync.register() == 0.0 and sync.registrations == []
    caches, current = [], 0
    for mask in masks:
        xor_weights(full, current ^ mask)
        current = mask
        timing = sync.update()
        caches.append(timing.cache)
        assert set(timing.ranks) == set(range(topo.world_size))
        got = [e.digest() for e in engines]
        assert tuple(map(sum, zip(*got))) == trainer_digest(full)
    return sync, caches


@pytest.mark.parametrize("fmt, ramp, ahead", [(fmt, False, True) for fmt in FORMATS]
                         + [("direct", True, True), ("compat", True, True),
                            ("direct", True, False), ("packed", False, False)])
def test_per_update_protocol_through_engine_processes_is_exact_and_recognises_every_bucket(
        cpu_engines, fmt, ramp, ahead):
    # ahead (the default): every later bucket serialized right after the first is posted,
    # before the later buckets are staged (direct: refilled arenas); without it each bucket's
    # bytes are made while the engines copy the one before - the engines' bits are the same
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 5)
    ptrs = [e.configure(SPEC, topo, r) for r, e in enumerate(cpu_engines)]
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    sync, caches = per_update(cpu_engines, fmt, topo, full, (0x0101, 0x0202, 0x0303),
                              staging_bytes=2 * layer + 100,  # direct: buckets on two arenas
                              bucket_bytes=2 * layer, bucket_ramp=ramp, serialize_ahead=ahead)
    assert sync.serialize_ahead is ahead
    if ramp:  # the first bucket one layer
        assert sync.sender.buckets[0].layers == [0] and len(sync.sender.buckets) >= 2
    assert_replayed_and_exact(sync, caches, cpu_engines, seed=5, mask=0x0303)
    cpu_engines[0].post_update(sync.sender.serialize(0, 0), sync.sender.load_format,
                               begin=False, end=False)  # one more bucket, outside an update
    assert dict(cpu_engines[0].result().param_ptrs) == ptrs[0]
    close_all(sync, cpu_engines)


@contextlib.contextmanager
def recorded(sync, engines):
    """The sender's serializations and the engines' posts, in the order they happen:
    ``("serialize", bucket, rank)`` and ``("post", bucket, rank, begin, end)`` (``bucket``:
    how many posts to that rank the log holds before; clear it between updates). Undone on
    exit: the module's engines serve the next tests unwrapped."""
    log: list = []
    serialize = sync.sender.serialize

    def recorded_serialize(index, rank, **kw):
        log.append(("serialize", index, rank))
        return serialize(index, rank, **kw)
    sync.sender.serialize = recorded_serialize
    for rank, engine in enumerate(engines):
        def recorded_post(*a, _post=engine.post_update, _rank=rank, **kw):
            sent = sum(1 for e in log if e[0] == "post" and e[2] == _rank)
            log.append(("post", sent, _rank, kw["begin"], kw["end"]))
            return _post(*a, **kw)
        engine.post_update = recorded_post
    try:
        yield log
    finally:
        del sync.sender.serialize
        for engine in engines:
            del engine.post_update


@pytest.mark.parametrize("per_update", [True, False])
@pytest.mark.parametrize("fmt", ["packed", "compat", "direct"])
def test_ranks_in_turn_send_every_bucket_to_one_rank_then_the_next_and_stay_exact(
        cpu_engines, fmt, per_update):
    # ranks_in_turn: rank 0 gets every bucket (begin on its first, end on its last), then
    # rank 1; each update's reports come rank by rank, bucket by bucket, and the bits, the
    # digests and the plan cache are those of the side-by-side order. direct at MoE-TP 2
    # stages its gate/up rows for both ranks at once: it keeps the side-by-side order.
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 9)
    ptrs = [e.configure(SPEC, topo, r) for r, e in enumerate(cpu_engines)]
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    sync = ColocatedSync(ColocatedSender(fmt, SPEC, topo, full, bucket_bytes=layer),
                         cpu_engines, per_update=per_update, ranks_in_turn=True)
    buckets = len(sync.sender.buckets)
    assert buckets >= 2 and sync.ranks_in_turn is (fmt != "direct")
    try:
        with recorded(sync, cpu_engines) as log:
            if not per_update:
                sync.register()  # shares made once, before any update
            caches, current = [], 0
            for mask in (0x0101, 0x0202, 0x0303):
                xor_weights(full, current ^ mask)
                current = mask
                log.clear()
                timing = sync.update()
                caches.append(sorted(timing.cache))
                digests = [e.digest() for e in cpu_engines]
                assert tuple(map(sum, zip(*digests))) == trainer_digest(full)
                assert all(dict(rep.param_ptrs) == ptrs[rep.rank]
                           for reports in timing.reports for rep in reports), "moved"
                post = lambda b, r: ("post", b, r, b == 0, b == buckets - 1)  # noqa: E731
                made = lambda b, r: ("serialize", b, r)  # noqa: E731
                if not sync.ranks_in_turn:  # every bucket to both ranks side by side
                    posts = [e for e in log if e[0] == "post"]
                    assert posts == [post(b, r) for b in range(buckets) for r in (0, 1)]
                    continue
                assert [[rep.rank for rep in reports] for reports in timing.reports] \
                    == [[r] for r in (0, 1) for _ in range(buckets)]
                marks = [(what, slot) for what, slot, _ in timing.clock if what == "posted"]
                assert marks == [("posted", slot) for slot in range(2 * buckets)]
                later = range(1, buckets)
                if per_update:  # serialized ahead: each rank's later buckets after its
                    # first post, rank 1's first bucket after rank 0's last post
                    assert log == ([made(0, 0), post(0, 0)] + [made(b, 0) for b in later]
                                   + [post(b, 0) for b in later] + [made(0, 1), post(0, 1)]
                                   + [made(b, 1) for b in later]
                                   + [post(b, 1) for b in later])
                else:
                    assert log == [post(b, r) for r in (0, 1) for b in range(buckets)]
        n = 2 * buckets
        assert caches == [["miss"] * n, ["hit"] * n, ["hit"] * n]
        assert [e.check(9, 0, 0x0303) for e in cpu_engines] == [None, None]
    finally:
        close_all(sync, cpu_engines)


def test_one_engine_rank_has_no_turns(cpu_engines):
    full = synth.grouped_full_weights(SPEC, 3)
    one = ColocatedSync(ColocatedSender("packed", SPEC, ReceiverTopology(), full),
                        cpu_engines[:1], ranks_in_turn=True)
    assert one.ranks_in_turn is False


def test_the_ranks_take_turns_by_default_only_where_they_share_the_senders_gpu(cpu_engines):
    # ranks_in_turn=None (the default): in turn where every engine rank copies on the
    # sender's GPU (one context at a time gains there: docs/performance.md), side by side
    # off a GPU and where a rank has a GPU of its own; True and False decide it.
    from types import SimpleNamespace

    from pytest_weightsync.reference_impl.senders.colocated import _on_gpu

    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 3)
    for choice, expected in ((None, False), (True, True), (False, False)):
        sync = ColocatedSync(ColocatedSender("packed", SPEC, topo, full), cpu_engines,
                             ranks_in_turn=choice)
        assert sync.ranks_in_turn is expected, choice
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    on = lambda device: SimpleNamespace(device=device)  # noqa: E731
    assert _on_gpu(on("cuda:0"), gpu0) and _on_gpu(on(gpu0), gpu0)
    assert not _on_gpu(on("cuda:1"), gpu0) and not _on_gpu(on("cuda:0"), gpu1)
    assert not _on_gpu(on("cpu"), torch.device("cpu")) and not _on_gpu(object(), gpu0)


@pytest.mark.parametrize("ahead", [False, True])
def test_serialize_ahead_makes_every_later_buckets_bytes_once_the_first_is_posted(
        cpu_engines, ahead):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 6)
    for r, e in enumerate(cpu_engines):
        e.configure(SPEC, topo, r)
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    # ahead is the default: the per-update protocol serializes ahead unless told not to
    sync = ColocatedSync(ColocatedSender("packed", SPEC, topo, full, bucket_bytes=layer),
                         cpu_engines, per_update=True,
                         **({} if ahead else {"serialize_ahead": False}))
    assert sync.serialize_ahead is ahead
    assert len(sync.sender.buckets) == 3  # one layer each
    try:
        with recorded(sync, cpu_engines) as log:
            sync.update()
        made = [[("serialize", b, r) for r in (0, 1)] for b in (1, 2)]
        sent = [[("post", b, r, False, b == 2) for r in (0, 1)] for b in (1, 2)]
        later = made[0] + made[1] + sent[0] + sent[1] if ahead else \
            made[0] + sent[0] + made[1] + sent[1]
        first = [("serialize", 0, 0), ("post", 0, 0, True, False), ("serialize", 0, 1),
                 ("post", 0, 1, True, False)]
        assert log == first + later
        assert tuple(map(sum, zip(*[e.digest() for e in cpu_engines]))) == trainer_digest(full)
    finally:
        close_all(sync, cpu_engines)


def test_engines_that_poll_their_pipe_serve_the_same_updates():
    # poll_s: each side polls before it blocks (SGLang's scheduler polls without sleeping);
    # what the engines load does not change, and a refused value is refused before a start
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 8)
    engines = [engine_process.ReceiverProcess("cpu", timeout=60, poll_s=0.02) for _ in range(2)]
    try:
        for r, engine in enumerate(engines):
            engine.configure(SPEC, topo, r)
        sync, caches = per_update(engines, "packed", topo, full, (0x0111, 0x0222))
        assert not sync.end_on_device and sync.events is None, "a CPU update ends on the host"
        assert caches[-1] == ["hit"] * len(sync.sender.buckets) * 2
        assert [e.check(8, 0, 0x0222) for e in engines] == [None, None]
    finally:
        for engine in engines:
            engine.close()
    for bad in (-1.0, float("nan")):
        with pytest.raises(engine_process.ReceiverProcessError, match="poll_s"):
            engine_process.ReceiverProcess("cpu", poll_s=bad)


def test_polling_a_pipe_sees_a_message_and_gives_up_after_its_time():
    import multiprocessing
    import time

    mine, theirs = multiprocessing.Pipe()
    try:
        t0 = time.perf_counter()
        assert engine_process._poll(mine, 0.01) is False
        assert time.perf_counter() - t0 >= 0.01
        theirs.send("x")
        assert engine_process._poll(mine, 10.0) is True and mine.recv() == "x"
    finally:
        mine.close()
        theirs.close()


def test_per_update_protocol_refuses_a_bad_bucket_and_keeps_the_parameters(cpu_engines):
    topo = ReceiverTopology()
    full = synth.grouped_full_weights(SPEC, 6)
    cpu_engines[0].configure(SPEC, topo, 0)
    per_update(cpu_engines[:1], "compat", topo, full, (0x0404, 0x0505))
    bad = [(n, t.float()) for n, t in senders.export("packed", SPEC, topo, 0, full, [0])]
    with pytest.raises(engine_process.ReceiverProcessError, match="dtype torch.float32"):
        cpu_engines[0].update(serialize_storages(bad), None)
    assert cpu_engines[0].check(6, 0, 0x0505) is None, "a refused bucket wrote something"
    cpu_engines[0].reset()


# --------------------------------------------------------------------------------------------
# A stateless sender: exported and shared anew every update, bucket after bucket
# --------------------------------------------------------------------------------------------


def stateless_rounds(engines, fmt, topo, *, seed, wire, bucket_layers, steps=3):
    """Updates from a :class:`StatelessSync` after the trainer's bits changed in place: the
    engine digests equal the trainer's after every update, every bucket after the first update
    is recognised (views of the same trainer memory; staged tensors the same memory again,
    from the sender's :class:`StagingPool`), addresses
    never move, and every element equals the oracle's after the last."""
    from pytest_weightsync.reference_impl.senders.stateless import StatelessSync

    full = synth.grouped_full_weights(SPEC, seed, device=engines[0].device)
    ptrs = [e.configure(SPEC, topo, r) for r, e in enumerate(engines)]
    for engine in engines:
        engine.reset(plan_cache=True)
    sync = StatelessSync(fmt, SPEC, topo, engines, wire=wire, bucket_layers=bucket_layers)
    mask = 0
    for step in range(steps):
        new = 0x2469 * (step + 1) & 0x7FFF
        xor_weights(full, mask ^ new)
        mask = new
        timing = sync.update(full)
        assert len(timing.reports) == len(sync.buckets(range(SPEC.num_layers)))
        reports = [r for bucket in timing.reports for r in bucket]
        assert all(dict(r.param_ptrs) == ptrs[r.rank] for r in reports), "parameters moved"
        if step:  # views of the same trainer memory, staging from the sender's pool: all known
            assert {c for r in reports for c in r.cache} == {"hit"}, [r.cache for r in reports]
        got = [e.digest() for e in engines]
        assert tuple(map(sum, zip(*got))) == trainer_digest(full), f"update {step}"
    assert [e.check(seed, 0, mask) for e in engines] == [None] * len(engines)


def test_staging_pool_gives_each_request_of_an_update_the_memory_it_got_last_update():
    from pytest_weightsync.reference_impl.senders.zerocopy import StagingPool

    pool = StagingPool()
    first = pool((2, 3), torch.bfloat16, "cpu", False)
    padded = pool((4,), torch.float32, "cpu", True)
    assert first.shape == (2, 3) and torch.equal(padded, torch.zeros(4))
    assert pool((2, 3), torch.bfloat16, "cpu", False) is not first, "handed out twice in an update"
    pool.rewind()
    assert pool((2, 3), torch.bfloat16, "cpu", False) is first
    other = pool((5,), torch.float32, "cpu", True)  # another request in that place: new memory
    assert other is not padded and torch.equal(other, torch.zeros(5))
    pool.rewind()
    assert pool.handed == 0
    assert pool((2, 3), torch.float16, "cpu", False) is not first, "another dtype"
    assert pool.handed == 1, "a sender tells by the count whether an export staged anything"


@pytest.mark.parametrize("fmt, tp, wire, bucket_layers", [
    ("direct", 2, "storages", 1), ("packed", 2, "tensors", 2), ("hf_fused", 1, "storages", 3),
    ("compat", 2, "storages", 2), ("compat", 1, "tensors", 1), ("direct", 1, "tensors", 1)])
def test_stateless_sender_streams_buckets_exactly(cpu_engines, fmt, tp, wire, bucket_layers):
    stateless_rounds(cpu_engines[:tp], fmt, ReceiverTopology(tp=tp), seed=9, wire=wire,
                     bucket_layers=bucket_layers)


def test_stateless_update_refused_by_an_engine_raises_and_leaves_nothing_pending(cpu_engines):
    from pytest_weightsync.reference_impl.errors import WeightSyncError
    from pytest_weightsync.reference_impl.senders.stateless import StatelessSync

    topo = ReceiverTopology(tp=2)
    stateless_rounds(cpu_engines, "packed", topo, seed=4, wire="storages", bucket_layers=1, steps=1)
    wider = type(SPEC)(num_layers=SPEC.num_layers, num_experts=SPEC.num_experts,
                       hidden=SPEC.hidden * 2, intermediate=SPEC.intermediate)
    sync = StatelessSync("packed", wider, topo, cpu_engines, bucket_layers=1)
    with pytest.raises(WeightSyncError, match="shape"):
        sync.update(synth.grouped_full_weights(wider, 4))
    assert not any(e.pending for e in cpu_engines), "an answer left pending"
    assert [e.check(4, 0, 0x2469) for e in cpu_engines] == [None, None], "a refused bucket wrote"
    stateless_rounds(cpu_engines, "packed", topo, seed=4, wire="storages", bucket_layers=1,
                     steps=1)  # the engines take the next update


def test_stateless_sender_refuses_a_bad_configuration_before_sending(cpu_engines):
    from pytest_weightsync.reference_impl.errors import WeightSyncError
    from pytest_weightsync.reference_impl.senders.stateless import StatelessSync

    topo = ReceiverTopology(tp=2)
    for kwargs, fragment in [(dict(wire="nccl"), "unknown wire 'nccl'"),
                             (dict(bucket_layers=0), "bucket_layers must be an int >= 1"),
                             (dict(bucket_layers=True), "bucket_layers must be an int >= 1")]:
        with pytest.raises(WeightSyncError, match=fragment):
            StatelessSync("packed", SPEC, topo, cpu_engines, **kwargs)
    with pytest.raises(WeightSyncError, match="1 engine process"):
        StatelessSync("packed", SPEC, topo, cpu_engines[:1])
    with pytest.raises(WeightSyncError, match="unknown payload format"):
        StatelessSync("fused", SPEC, topo, cpu_engines)
    assert not any(e.pending for e in cpu_engines)


# --------------------------------------------------------------------------------------------
# GPU: the same path over CUDA IPC
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, tp", [("direct", 1), ("packed", 2), ("compat", 1), ("direct", 2)])
def test_gpu_per_update_protocol_over_cuda_ipc_is_exact_and_replays_cuda_graphs(fmt, tp):
    # one layer per bucket: buckets of views are answered before their copies finish; packed
    # at MoE-TP 2 with the engine ranks in turn (rank 1's copies wait on the device for rank
    # 0's last), staged direct at MoE-TP 2 side by side (its staged buckets keep their events)
    def digests_agree(engines, full, step):
        got = [e.digest() for e in engines]
        assert tuple(map(sum, zip(*got))) == trainer_digest(full), f"update {step}"

    gpu_sync_rounds(fmt, tp, seed=7, steps=5, per_update=True, bucket_layers=True,
                    check_sender=lambda sender: len(sender.buckets) == 3,
                    after_update=digests_agree, ranks_in_turn=fmt == "packed")


@pytest.mark.gpu
def test_gpu_update_ends_when_the_device_has_copied_before_the_trainer_writes_again():
    # end_on_device: the engines answer the last bucket once its copies are queued (no memory
    # figures asked for) and the trainer waits for their IPC events; without it the engines
    # wait, also for a staged bucket ordered by events (direct at MoE-TP 2). The trainer then
    # writes its weights again at once, on the device: a copy not yet done reads new bits.
    # One pair of engine processes for every case: starting CUDA in a process costs seconds.
    spec = MoESpec(num_layers=2, num_experts=64, hidden=1024, intermediate=512)
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(spec, 21, device="cuda")
    engines = [engine_process.ReceiverProcess("cuda:0", timeout=120) for _ in range(2)]
    # (format, per-update, end on the device, ranks in turn: rank 1's copies wait on the
    # device for rank 0's last, and the update still ends only when rank 1's are done)
    cases = [("packed", False, True, False), ("packed", True, True, False),
             ("direct", False, True, False), ("direct", True, False, False),
             ("hf_fused", True, True, True), ("compat", False, True, True)]
    try:
        mask = 0
        for fmt, per_update, end_on_device, in_turn in cases:
            for r, engine in enumerate(engines):
                engine.configure(spec, topo, r)
            sync = ColocatedSync(ColocatedSender(fmt, spec, topo, full, bucket_ramp=True,
                                                 staging_bytes=1 << 30),
                                 engines, per_update=per_update, end_on_device=end_on_device,
                                 ranks_in_turn=in_turn)
            assert sync.end_on_device == end_on_device and sync.ranks_in_turn == in_turn
            assert (sync.sender.staged_bytes > 0) == (fmt == "direct")
            for step in range(3):
                new = (0x1111 * (step + 1) ^ mask) & 0x7FFF or 0x0101
                xor_weights(full, mask ^ new)
                mask = new
                timing = sync.update()
                xor_weights(full, 0x7FFF)  # queued at once, before anything waits
                if end_on_device:
                    assert all(r.memory is None for r in timing.reports[-1]), "an engine waited"
                got = [e.digest() for e in engines]
                xor_weights(full, 0x7FFF)  # back to what the update sent
                assert tuple(map(sum, zip(*got))) == trainer_digest(full), (
                    f"{fmt} per_update={per_update} end_on_device={end_on_device} "
                    f"ranks_in_turn={in_turn} update {step}: the engines' copies read what "
                    f"the trainer wrote after it")
            assert [e.check(21, 0, mask) for e in engines] == [None, None]
            sync.close()
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.gpu
def test_gpu_stateless_sender_streams_buckets_exactly_over_cuda_ipc():
    # one pair of engine processes for every case: starting CUDA in a process costs seconds
    engines = [engine_process.ReceiverProcess("cuda:0", timeout=120) for _ in range(2)]
    try:
        for fmt, tp, wire in [("direct", 2, "storages"), ("compat", 1, "tensors")]:
            stateless_rounds(engines[:tp], fmt, ReceiverTopology(tp=tp), seed=11, wire=wire,
                             bucket_layers=1)
    finally:
        for engine in engines:
            engine.close()
