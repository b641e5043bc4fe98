"""A parameters check is skipped only for the very tensors it passed, each as it was: any
in-place change a check reads (storage swapped, freed or shrunk, shape, strides, dtype, type,
a lazy view) runs the check again, so a memoized receiver refuses exactly what a fresh one
refuses; the memo keeps no tensor alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pytest_weightsync.reference_impl.engine import checked_memo
from pytest_weightsync.reference_impl.engine.checked_memo import CheckedMemo
from pytest_weightsync.reference_impl.engine.receiver import (
    ReceiverParamsError,
    ReferenceReceiver,
    checked_params,
    rank_layout,
)
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.suites.harness import inputs
from pytest_weightsync.suites.harness.cases import Case

CASE = Case(MoESpec(num_layers=2, num_experts=4, hidden=16, intermediate=8),
            TrainerTopology(tp=2, ep=1), ReceiverTopology(tp=2))
RANK = 1


def _wants():
    _, shapes = rank_layout(CASE.spec, CASE.receiver, RANK)
    return {name: (shape, CASE.spec.dtype) for name, shape in shapes}


class _Counting:
    """``checked_params``, counting its runs."""

    def __init__(self):
        self.runs = 0

    def __call__(self, *args):
        self.runs += 1
        return checked_params(*args)


def _outcome(fn):
    """What a check comes to: the error's class and words, or each tensor it returned (its
    object, address, shape and dtype)."""
    try:
        got = fn()
    except Exception as error:
        return type(error), str(error)
    return {name: (id(t), t.data_ptr(), tuple(t.shape), t.dtype) for name, t in got.items()}


class _Other(torch.nn.Parameter):
    """A parameter subclass an object can be turned into in place (``__class__`` assigned)."""


def _mutations():
    """In-place changes of one parameter that keep it the same object (plus one rebinding)."""
    def resized(t):
        t.resize_(t.numel() + 64)  # a new, larger storage: a new address
        return t.resize_(*t.shape)

    return {
        "set_ to another storage": lambda t: t.set_(t.detach().clone()),
        ".data rebound": lambda t: (setattr(t, "data", t.detach().clone()), t)[1],
        "resized away and back": resized,
        "storage freed": lambda t: (t.untyped_storage().resize_(0), t)[1],
        "transposed in place": lambda t: t.transpose_(0, 1),
        "shrunk in place": lambda t: t.resize_(t.shape[0] - 1, *t.shape[1:]),
        "reinterpreted as another dtype": lambda t: (
            setattr(t, "data", t.detach().view(torch.int16)), t)[1],
        "column-major in place": lambda t: t.as_strided_(
            t.shape, tuple(reversed(torch.empty(tuple(reversed(t.shape))).stride()))),
        "a lazy negation view swapped in": lambda t: (
            setattr(t, "data", t.detach()._neg_view()), t)[1],
        "class reassigned": lambda t: (setattr(t, "__class__", _Other), t)[1],
    }


@pytest.fixture(params=["native guard", "python comparison"])
def guard_mode(request, monkeypatch):
    """Both ways an entry compares its tensors: the native guard (the pinned torch has it:
    the fast path must not vanish unnoticed) and the Python state tuple standing in for it."""
    if request.param == "native guard":
        assert checked_memo.native_metadata_guard([torch.zeros(2)]) is not None
    else:
        monkeypatch.setattr(checked_memo, "native_metadata_guard", lambda tensors: None)
    return request.param


def _params():
    return {name: torch.nn.Parameter(t, requires_grad=False)
            for name, t in inputs.receiver_params(CASE, RANK).items()}


def test_the_same_tensors_unchanged_are_checked_once(guard_mode):
    memo, check, params, wants = CheckedMemo(), _Counting(), _params(), _wants()
    first = memo.checked(check, params, wants, RANK, "the topology")
    for _ in range(3):
        again = memo.checked(check, params, dict(wants), RANK, "the topology")
        assert again == first and all(again[n] is first[n] for n in first)
    assert check.runs == 1
    assert memo._entries[id(params)].guard is not None if guard_mode == "native guard" else True


@pytest.mark.parametrize("what", list(_mutations()))
def test_a_parameter_changed_in_place_is_checked_again(what, guard_mode):
    """After the change the memo's answer is the check's own (its result, or its refusal),
    never the earlier pass."""
    memo, check, params, wants = CheckedMemo(), _Counting(), _params(), _wants()
    memo.checked(check, params, wants, RANK, "the topology")
    name = sorted(wants)[-1]
    changed = _mutations()[what](params[name])
    assert changed is params[name]
    assert (_outcome(lambda: memo.checked(check, params, wants, RANK, "the topology"))
            == _outcome(lambda: checked_params(params, wants, RANK, "the topology")))
    assert check.runs == 2, what


def test_another_tensor_name_rank_or_wants_is_checked_again():
    memo, check, params, wants = CheckedMemo(), _Counting(), _params(), _wants()
    memo.checked(check, params, wants, RANK, "the topology")
    name = sorted(wants)[0]
    params[name] = params[name].detach().clone()  # a new object under the same name
    memo.checked(check, params, wants, RANK, "the topology")
    memo.checked(check, params, wants, RANK + 1, "the topology")
    fewer = dict(list(wants.items())[:1])
    assert set(memo.checked(check, params, fewer, RANK + 1, "the topology")) == set(fewer)
    assert check.runs == 4
    with pytest.raises(ReceiverParamsError, match="has no parameter"):
        memo.checked(check, {name: params[name]}, wants, RANK, "the topology")


def test_a_mapping_other_than_a_dict_is_always_checked():
    class Params(dict):
        pass

    memo, check, wants = CheckedMemo(), _Counting(), _wants()
    params = Params(_params())
    for _ in range(2):
        memo.checked(check, params, wants, RANK, "the topology")
    assert check.runs == 2 and len(memo) == 0


def test_the_memo_keeps_no_tensor_alive_and_stays_bounded():
    memo = CheckedMemo(max_entries=2)
    params = _params()
    refs = [weakref.ref(t) for t in params.values()]
    memo.checked(checked_params, params, _wants(), RANK, "the topology")
    del params
    gc.collect()
    assert all(ref() is None for ref in refs)
    kept = [_params() for _ in range(3)]
    for params in kept:
        memo.checked(checked_params, params, _wants(), RANK, "the topology")
    assert len(memo) == 2


def test_a_receiver_built_again_refuses_what_a_fresh_check_refuses():
    """The receivers the reference builds per call share one memo: a parameter freed between
    two calls is refused by name on the second, as it would be on a first."""
    params = _params()
    ReferenceReceiver(CASE.spec, CASE.receiver, RANK, params=params)
    name = sorted(params)[0]
    params[name].untyped_storage().resize_(0)
    with pytest.raises(ReceiverParamsError, match=f"{name}.*storage was freed"):
        ReferenceReceiver(CASE.spec, CASE.receiver, RANK, params=params)
