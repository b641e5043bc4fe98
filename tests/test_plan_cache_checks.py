"""The plan cache skips a caller's own check only for a bucket it recognises as one that
passed that check (the registered loader's format check on a cache hit); it recognises a list
of the very tensor objects it validated without building the signature, and never one whose
objects changed in place; the contiguous shortcut of ``tensor_checks.view_bytes`` equals the
general formula."""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl import impl as reference
from pytest_weightsync.reference_impl.engine import tensor_checks
from pytest_weightsync.reference_impl.engine.plan_cache import LoadCache
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.senders.formats import PayloadFormatError
from pytest_weightsync.suites.harness import inputs, judge, loader
from pytest_weightsync.suites.harness.cases import Case

CASE = Case(MoESpec(num_layers=1, num_experts=4, hidden=16, intermediate=8),
            TrainerTopology(tp=2, ep=1), ReceiverTopology(tp=2))
RANK = 1


def _bucket(fmt="packed"):
    (bucket,) = inputs.stream(fmt, CASE, RANK, 1, bucket="whole")
    return list(bucket)


def test_a_callers_check_runs_on_a_miss_and_is_skipped_only_on_a_hit_under_its_tag():
    receiver = ReferenceReceiver(CASE.spec, CASE.receiver, RANK,
                                 params=inputs.receiver_params(CASE, RANK), plan_cache=True)
    bucket, checked = _bucket(), []

    def check(items):
        checked.append(len(items))

    for tag, runs in (("a", 1), ("a", 1), ("b", 2), ("b", 2), ("a", 3)):
        receiver.load(bucket, check=check, check_tag=tag)
        assert len(checked) == runs, (tag, checked)
    assert receiver.plan_cache.stats.hits == 4  # the last three also replayed the copy plan
    other = ReferenceReceiver(CASE.spec, CASE.receiver, RANK,
                              params=inputs.receiver_params(CASE, RANK), plan_cache=True)
    before = {n: t.clone() for n, t in other.params.items()}

    def refuse(items):
        raise PayloadFormatError("refused by the caller's check")

    with pytest.raises(PayloadFormatError):
        other.load(bucket, check=refuse, check_tag="a")
    assert len(other.plan_cache) == 0  # nothing stored, nothing written
    assert all(torch.equal(before[n], t) for n, t in other.params.items())


def test_the_reference_checks_the_format_of_a_bucket_it_cached_under_another():
    """packed and hf_fused share a load format, so the same bucket lands in the same cache slot
    under either; a hit under the other format must still be refused by the format check."""
    impl = reference.ReferenceImplementation()
    caches = {}
    impl._plan_cache_for = lambda receiver, spec, topology: caches.setdefault(0, LoadCache())
    params = inputs.receiver_params(CASE, RANK)
    bucket = _bucket("packed")
    for _ in range(2):
        loader.load_stream(impl, params, [bucket], "packed", CASE, RANK)
    assert caches[0].stats.hits == 1
    judge.check_rank(params, CASE, RANK, 1)
    kwargs = dict(format="hf_fused", spec=CASE.spec, topology=CASE.receiver, rank=RANK)
    with pytest.raises(PayloadFormatError, match="hf_fused"):
        impl.load_weights(params, list(bucket), **kwargs)
    assert caches[0].stats.hits == 1


@pytest.mark.parametrize("make", [
    lambda: torch.empty(6, 5),
    lambda: torch.empty(40)[3:33].view(6, 5),
    lambda: torch.empty(6, 5)[:, :3],
    lambda: torch.empty(6, 5).t(),
    lambda: torch.empty(0, 5),
    lambda: torch.empty(2, 5).as_strided((1, 5), (99, 1), 2),
    lambda: torch.empty(8, dtype=torch.bfloat16)[2:],
    lambda: torch.empty(()),
])
def test_view_bytes_of_a_contiguous_tensor_equals_the_general_formula(make):
    tensor = make()
    span = (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) + 1
            if tensor.numel() else 0)
    want = (tensor.storage_offset() + span) * tensor.element_size() if span else 0
    assert tensor_checks.view_bytes(tensor) == want


def _same_objects_receiver():
    receiver = ReferenceReceiver(CASE.spec, CASE.receiver, RANK,
                                 params=inputs.receiver_params(CASE, RANK), plan_cache=True)
    return receiver, _bucket("compat")


def _as_views_of_one_buffer(bucket):
    """The same (name, values) as views at growing offsets of one flat buffer."""
    flat = torch.cat([t.reshape(-1) for _, t in bucket])
    out, offset = [], 0
    for name, tensor in bucket:
        out.append((name, flat[offset:offset + tensor.numel()].view(tensor.shape)))
        offset += tensor.numel()
    return out


def _record_calls(monkeypatch, *names) -> list:
    """The names of the plan cache's functions ``names`` in the order they get called."""
    from pytest_weightsync.reference_impl.engine import plan_cache

    calls = []
    for name in names:
        real = getattr(plan_cache, name)
        monkeypatch.setattr(plan_cache, name,
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    return calls


@pytest.mark.parametrize("layout", ["separate tensors", "views of one buffer"])
def test_a_list_of_the_same_tensor_objects_is_recognised_without_its_signature(monkeypatch,
                                                                              layout):
    receiver, bucket = _same_objects_receiver()
    if layout == "views of one buffer":
        bucket = _as_views_of_one_buffer(bucket)
    receiver.load(list(bucket))  # validated, planned, signature and objects kept
    receiver.load(list(bucket))
    computed = _record_calls(monkeypatch, "_list_signature")
    for _ in range(3):
        receiver.load([(n, t) for n, t in bucket])  # new list, new tuples, the same objects
    assert computed == [] and receiver.plan_cache.stats.hits == 4


def test_a_list_of_the_same_tuples_is_recognised_without_reading_its_entries(monkeypatch):
    """A sender that offers the very ``(name, tensor)`` tuples again: neither the pairs check,
    the names nor the signature are computed; one tuple replaced (even by an equal one) and
    the list is read again."""
    receiver, bucket = _same_objects_receiver()
    receiver.load(bucket)
    receiver.load(bucket)
    read = _record_calls(monkeypatch, "_pairs", "_list_signature")
    receiver.load(bucket)
    receiver.load(tuple(bucket))
    assert read == [] and receiver.plan_cache.stats.counts == {"miss": 1, "hit": 3}
    bucket[3] = (bucket[3][0], bucket[3][1])  # a new tuple of the same name and tensor
    receiver.load(bucket)
    assert read == ["_pairs"] and receiver.plan_cache.stats.last == "hit"
    judge.check_rank(receiver.params, CASE, RANK, 1)


def test_a_list_holding_one_tensor_twice_is_still_recognised_by_identity(monkeypatch):
    """The native guard refuses a list that holds one object twice; such a list keeps the
    Python comparison and is still recognised without its signature."""
    receiver, bucket = _same_objects_receiver()
    (n0, t0), (n1, t1) = bucket[0], bucket[1]
    assert t0.shape == t1.shape and t0.dtype == t1.dtype
    bucket[1] = (n1, t0)  # expert 0's gate_proj sent again as the next entry's values
    receiver.load(list(bucket))
    receiver.load(list(bucket))
    computed = _record_calls(monkeypatch, "_list_signature")
    for _ in range(3):
        receiver.load([(n, t) for n, t in bucket])
    assert computed == [] and plan_cache_same(receiver).guard is None
    assert receiver.plan_cache.stats.counts == {"miss": 1, "hit": 4}


def _mutations():
    """In-place changes of one tensor object that keep it the same object."""
    def resized(t):
        t.resize_(t.numel() + 64)  # a new, larger storage: new address
        t.resize_(t.shape[0] - 64)
        return t

    return {
        "set_ to another storage": lambda t: t.set_(t.detach().clone()),
        ".data rebound": lambda t: (setattr(t, "data", t.detach().clone()), t)[1],
        "resized in place": resized,
        "transposed in place": lambda t: t.t_() if t.dim() == 2 else t.unsqueeze_(0),
        "storage moved to another dtype view": lambda t: t.set_(
            t.detach().clone().view(torch.int16).view(t.dtype)),
        # the same address, other metadata: only the shape, stride or dtype comparison sees it
        "shrunk in place": lambda t: t.resize_(t.shape[0] - 1, *t.shape[1:]),
        "reinterpreted as another dtype": lambda t: (
            setattr(t, "data", t.detach().view(torch.int16)), t)[1],
        "column-major in place": lambda t: t.as_strided_(t.shape, (1, t.shape[0])),
        "class reassigned": lambda t: (setattr(t, "__class__", _Subclass), t)[1],
    }


class _Subclass(torch.Tensor):
    """A tensor subclass an object can be turned into in place (``__class__`` assigned)."""


@pytest.fixture(params=["native guard", "python comparison"])
def metadata_check(request, monkeypatch):
    """Each way :class:`_SameTensors` compares metadata: the native guard where this torch
    has one (the pinned torch has: the fast path must not vanish unnoticed), and the Python
    comparison that stands in elsewhere."""
    from pytest_weightsync.reference_impl.engine import plan_cache

    if request.param == "native guard":
        assert plan_cache.native_metadata_guard([torch.zeros(2)]) is not None
    else:
        monkeypatch.setattr(plan_cache, "native_metadata_guard", lambda tensors: None)
    return request.param


@pytest.mark.parametrize("what", list(_mutations()))
def test_a_tensor_object_changed_in_place_is_not_recognised_by_identity(what, metadata_check):
    """The same objects, one changed in place: the identity check must not pass it; the
    signature (or the full path) decides: what lands is what a receiver without a cache
    makes of the changed bucket (its values, or its refusal)."""
    receiver, bucket = _same_objects_receiver()
    receiver.load(list(bucket))
    receiver.load(list(bucket))
    receiver.load(list(bucket))  # the first identity check made the native guard, if any
    name, tensor = max(bucket, key=lambda item: item[1].numel())
    before = plan_cache_same(receiver)
    assert (before.guard is not None) == (metadata_check == "native guard")
    changed = _mutations()[what](tensor)
    assert changed is tensor
    assert not before.holds([t for _, t in bucket]), what
    fresh = ReferenceReceiver(CASE.spec, CASE.receiver, RANK,
                              params=inputs.receiver_params(CASE, RANK))
    try:  # what a receiver that never saw the bucket makes of it now
        fresh.load(list(bucket))
    except Exception as refused:
        with pytest.raises(type(refused)):  # the cached receiver refuses it as well
            receiver.load(list(bucket))
        return
    receiver.load(list(bucket))
    for name, param in fresh.params.items():
        assert torch.equal(receiver.params[name].view(torch.int16),
                           param.view(torch.int16)), name


def plan_cache_same(receiver):
    (entry,) = [e for e in receiver.plan_cache._slots.values()]
    return entry.same


def test_an_open_update_keeps_no_bucket_alive():
    """A bucket loaded without a plan cache is released once its load returns, though the
    update is still open (its plan, which views the bucket's tensors, is not kept)."""
    import gc
    import weakref

    receiver = ReferenceReceiver(CASE.spec, CASE.receiver, RANK,
                                 params=inputs.receiver_params(CASE, RANK))
    receiver.begin_update()
    bucket = _bucket("compat")
    refs = [weakref.ref(t) for _, t in bucket]
    receiver.load(bucket)
    del bucket
    gc.collect()
    assert all(ref() is None for ref in refs)
    receiver.end_update()
