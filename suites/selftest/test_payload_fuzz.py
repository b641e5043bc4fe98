"""Fuzzing the reference receiver with broken buckets: a PayloadError, and nothing written.

Each mutation breaks one entry (or the bucket itself) of a valid bucket of one format in a
way a real sender could: a name respelled (leading zero, non-ASCII digit, trailing newline,
case, suffix), a piece carried twice or in another format, a wrong dtype, shape, device or
layout, a source that aliases a receiver parameter the bucket writes, an id of thousands of
digits, a 10 kB name, something that is not a tensor or not a pair at all. Whatever the
mutation and whichever entry it hits, the receiver must raise a ``PayloadError`` - any other
exception type is a failure - and every parameter must keep its raw bits and its address.

A deterministic sweep runs every mutation on every format it applies to; Hypothesis then
draws mutation, format, receiver rank and entry freely.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pytest_weightsync.vocabulary import FORMATS, LOAD_FORMAT

from ..harness.cases import Case
from ..harness.inputs import gathered_weights, payload
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import (MoESpec, ReceiverTopology, TrainerTopology,
                                                     hf_expert_name, hf_fused_name,
                                                     parse_receiver_name)

pytestmark = pytest.mark.weightsync_property("bad_payload_refused")

#: hidden == intermediate: square projections, so a transposed one keeps its shape.
SPEC = MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=8)
CASES = {
    "ep2": Case(SPEC, TrainerTopology(ep=2), ReceiverTopology(tp=2, moe_ep=2)),
    "tp2-padded": Case(SPEC, TrainerTopology(tp=2, etp=2),
                       ReceiverTopology(tp=2, order="up_gate", intermediate_padded=5)),
}
TARGETS = [(key, rank) for key, case in CASES.items() for rank in range(case.receiver.tp)]


@functools.lru_cache(maxsize=None)
def _receiver(key, rank):
    rec = rx.ReferenceReceiver(CASES[key].spec, CASES[key].receiver, rank)
    for tensor in rec.params.values():
        synth.poison_(tensor)
    return rec


@functools.lru_cache(maxsize=None)
def _bucket(fmt, key, rank):
    """A valid bucket (both layers) of ``fmt``; shared, so mutations must never write to it."""
    case = CASES[key]
    return tuple(payload(fmt, case, rank, full=gathered_weights(case, 1)))


def _digits(name, change):
    """``name`` with its first id changed by ``change(token) -> token``."""
    head, _, rest = name.partition("model.layers.")
    layer, _, tail = rest.partition(".")
    return f"{head}model.layers.{change(layer)}.{tail}"


def _rename(new_name):
    def mutate(bucket, i, rec):
        name, tensor = bucket[i]
        bucket[i] = (new_name(name), tensor)
        return bucket
    return mutate


def _retensor(new_tensor):
    def mutate(bucket, i, rec):
        name, tensor = bucket[i]
        replacement = new_tensor(tensor, name, rec)
        if replacement is None:
            return None
        bucket[i] = (name, replacement)
        return bucket
    return mutate


def _whole(new_bucket):
    return lambda bucket, i, rec: new_bucket(bucket)


def _append(extra):
    def mutate(bucket, i, rec):
        item = extra(bucket, i, rec)
        return None if item is None else bucket + [item]
    return mutate


def _other_format_piece(bucket, i, rec):
    """The same layer in another format's spelling (a duplicate piece, or a format mix)."""
    parsed = parse_receiver_name(bucket[i][0])
    if parsed.kind == "expert":
        return (hf_fused_name(parsed.layer, "down"),
                torch.zeros(SPEC.num_experts, SPEC.hidden, SPEC.intermediate, dtype=SPEC.dtype))
    return (hf_expert_name(parsed.layer, 0, "down"), torch.zeros(SPEC.hf_shape("down"),
                                                                 dtype=SPEC.dtype))


def _alias_written_param(tensor, name, rec):
    """A view with ``tensor``'s shape over a receiver parameter this bucket writes."""
    for param in rec.params.values():  # every parameter: the bucket holds both layers
        if param.numel() >= tensor.numel() and param.is_contiguous():
            return param.view(-1)[:tensor.numel()].view(tensor.shape)
    return None


def _non_contiguous(tensor, name, rec):
    if tensor.dim() < 2:
        return None
    return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)


MUTATIONS = {
    "leading-zero-layer": _rename(lambda n: _digits(n, lambda t: "0" + t)),
    "unicode-digit-layer": _rename(lambda n: _digits(n, lambda t: t.replace("0", "\u0660")
                                                     .replace("1", "\u0661"))),
    "fullwidth-digit-layer": _rename(lambda n: _digits(n, lambda t: t.replace("0", "\uff10")
                                                       .replace("1", "\uff11"))),
    "trailing-newline": _rename(lambda n: n + "\n"),
    "leading-space": _rename(lambda n: " " + n),
    "upper-case": _rename(lambda n: n.replace("model.", "Model.")),
    "suffix": _rename(lambda n: n + ".bias"),
    "huge-layer-id": _rename(lambda n: _digits(n, lambda t: "7" * 5000)),
    "layer-out-of-range": _rename(lambda n: _digits(n, lambda t: str(SPEC.num_layers))),
    "name-10kb": _rename(lambda n: n + "x" * 10_000),
    "empty-name": _rename(lambda n: ""),
    "bytes-name": _rename(lambda n: n.encode()),
    "int-name": _rename(lambda n: 3),
    "duplicate-same-name": lambda b, i, rec: b + [b[i]],
    "duplicate-other-spelling": _append(_other_format_piece),
    "float32": _retensor(lambda t, n, r: t.float()),
    "float16": _retensor(lambda t, n, r: t.half()),
    "int16-bits": _retensor(lambda t, n, r: t.view(torch.int16)),
    "shape-off-by-one": _retensor(lambda t, n, r: t[..., :-1]),
    "shape-extra-dim": _retensor(lambda t, n, r: t.unsqueeze(0)),
    "scalar": _retensor(lambda t, n, r: t.reshape(-1)[0]),
    "empty-tensor": _retensor(lambda t, n, r: t.reshape(-1)[:0]),
    "sparse": _retensor(lambda t, n, r: t.to_sparse()),
    "meta-device": _retensor(lambda t, n, r: torch.empty_like(t, device="meta")),
    "alias-of-written-param": _retensor(_alias_written_param),
    "non-tensor-list": _retensor(lambda t, n, r: t.tolist()),
    "str-tensor": _retensor(lambda t, n, r: "not a tensor"),
    "none-tensor": lambda b, i, rec: b[:i] + [(b[i][0], None)] + b[i + 1:],
    "entry-none": lambda b, i, rec: b[:i] + [None] + b[i + 1:],
    "entry-triple": lambda b, i, rec: b[:i] + [b[i] + (None,)] + b[i + 1:],
    "entry-list": lambda b, i, rec: b[:i] + [list(b[i])] + b[i + 1:],
    "payload-none": _whole(lambda b: None),
    "payload-dict": _whole(lambda b: dict(b)),
    "payload-tensor": _whole(lambda b: b[0][1]),
}
#: Mutations that break only some formats (the others legitimately accept the result). A
#: transposed square tensor is none: its shape is right and every format, direct included
#: (SGLang's ``default_weight_loader`` copies any strides), takes it as data.
ONLY: dict = {}


def _mutated(kind, fmt, key, rank, index):
    rec = _receiver(key, rank)
    bucket = list(_bucket(fmt, key, rank))
    mutated = MUTATIONS[kind](bucket, index % len(bucket), rec)
    return rec, mutated


def _refused_and_unchanged(kind, fmt, key, rank, index) -> bool:
    """False when the mutation does not apply; raises when the receiver misbehaves."""
    if fmt not in ONLY.get(kind, set(FORMATS)):
        return False
    rec, bucket = _mutated(kind, fmt, key, rank, index)
    if bucket is None and kind != "payload-none":
        return False
    before = compare.snapshot(rec.params)
    with pytest.raises(rx.PayloadError) as info:
        rec.load(bucket, load_format=LOAD_FORMAT[fmt])
    assert len(str(info.value)) < 1000, f"{kind}: unbounded message ({len(str(info.value))} chars)"
    assert kind.startswith("payload-") or "payload entry" in str(info.value), str(info.value)
    compare.assert_unchanged(before, rec.params, rank=rank)
    return True


def test_there_are_enough_mutation_kinds():
    assert len(MUTATIONS) >= 25


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", sorted(MUTATIONS))
def test_every_mutation_is_refused_on_every_format(kind, fmt):
    applied = [_refused_and_unchanged(kind, fmt, key, rank, -1) for key, rank in TARGETS]
    if not any(applied):
        pytest.skip(f"{kind} does not apply to {fmt} payloads")


@given(kind=st.sampled_from(sorted(MUTATIONS)), fmt=st.sampled_from(FORMATS),
       target=st.sampled_from(TARGETS), index=st.integers(0, 63))
@settings(max_examples=120, deadline=None)
def test_fuzzed_bucket_is_refused_and_writes_nothing(kind, fmt, target, index):
    assume(_refused_and_unchanged(kind, fmt, *target, index))
