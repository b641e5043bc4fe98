"""Conformance of every registered loader (``load_weights``) to the reference, bit for bit.

Each test runs once per registered implementation with a loader role (``weightsync_loader``,
the test id carries its name) and states one property:

- ``bit_exact``: every format it claims, on every topology of the matrix it claims, leaves
  every receiver rank's expert parameters equal to the expected state in every bit;
- ``in_place``: a payload of one layer writes that layer at unchanged addresses and leaves
  every other parameter (other layers, the router weight) bit-identical;
- ``no_stale_values``: three successive versions into the same buffers, each fully visible;
- ``rejects_bad_input``: a bad entry at the end of an otherwise valid payload raises a
  ``ValueError``/``TypeError`` naming the problem, and nothing was written;
- ``fallback_routing``: with a capability taken away, ``reference_impl.select`` routes the
  update down a path the loader claims, and that path lands bit-exact too.

What an implementation does not claim is skipped with the reason - never passed.
"""

from __future__ import annotations

import pytest

import conformance_harness as ch
import matrix
from pytest_weightsync import compare
from reference_impl.layout import fused_name, receiver_shard

ANCHORS = [pytest.param(case, id=case.id) for case in matrix.ANCHORS]


def _require_claim(impl, case, fmt=None):
    ch.require_claim(impl, "loader", case, fmt)


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", ch.FORMATS)
def test_loader_lands_bit_exact_on_every_rank(weightsync_loader, moe_case, payload_format):
    _require_claim(weightsync_loader, moe_case, payload_format)
    for rank in range(moe_case.receiver.world_size):
        params = ch.receiver_params(moe_case, rank)
        before = compare.snapshot(params)
        ch.load(weightsync_loader, params, payload_format, moe_case, rank, version=1)
        ch.check_rank(params, moe_case, rank, 1, before)


@pytest.mark.weightsync_property("in_place")
@pytest.mark.parametrize("payload_format", ch.FORMATS)
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_writes_in_place_and_only_the_payload(weightsync_loader, case, payload_format):
    _require_claim(weightsync_loader, case, payload_format)
    layer = case.spec.num_layers - 1
    for rank in range(case.receiver.world_size):
        params = ch.receiver_params(case, rank)
        before = compare.snapshot(params)
        ch.load(weightsync_loader, params, payload_format, case, rank, version=2, layers=[layer])
        ch.check_rank(params, case, rank, 2, before,
                      touched=[fused_name(layer, "w13"), fused_name(layer, "w2")])


@pytest.mark.weightsync_property("no_stale_values")
@pytest.mark.parametrize("payload_format", ch.FORMATS)
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_repeated_updates_leave_no_stale_value(weightsync_loader, case, payload_format):
    """Versions differ in every element, so any element a later update misses shows."""
    _require_claim(weightsync_loader, case, payload_format)
    for rank in range(case.receiver.world_size):
        params = ch.receiver_params(case, rank)
        before = compare.snapshot(params)
        for version in (1, 2, 3):
            ch.load(weightsync_loader, params, payload_format, case, rank, version)
            ch.check_rank(params, case, rank, version, before,
                          previous_version=version - 1 if version > 1 else None)


# --- bad input ---------------------------------------------------------------------------------


def _owned_index(chunk, case, rank, projection=None):
    """Index of the last entry of ``chunk`` that receiver ``rank`` actually loads (of
    ``projection``, when given)."""
    from reference_impl.layout import parse_receiver_name

    shard = receiver_shard(case.spec, case.receiver, rank)
    for index in range(len(chunk) - 1, -1, -1):
        parsed = parse_receiver_name(chunk[index][0])
        if projection is not None and parsed.projection != projection:
            continue
        if parsed.expert is None or parsed.expert in shard.experts:
            return index
    raise AssertionError(f"receiver rank {rank} owns no entry of the payload")


def _bad_payload(kind, fmt, case, rank):
    """``(payload, words the error must mention)``: a valid payload of every layer whose
    last entry is the bad one (so a loader that writes as it validates is caught)."""
    import torch

    chunk = ch.payload(fmt, case, rank, version=1)
    # missing_expert drops an owned expert's up_proj: its gate_proj still touches w13.
    name, tensor = chunk.pop(_owned_index(chunk, case, rank,
                                          "up" if kind == "missing_expert" else None))
    spec = case.spec
    if kind == "wrong_dtype":
        return chunk + [(name, tensor.to(torch.float32))], ["dtype"]
    if kind == "wrong_shape":
        return chunk + [(name, tensor[..., :-1].contiguous())], ["shape"]
    if kind == "unknown_name":
        bogus = "model.layers.0.mlp.experts.w13_weight_scale" if fmt != "compat" else \
            "model.layers.0.mlp.experts.0.gate_proj.weight_scale"
        return chunk + [(name, tensor), (bogus, tensor.clone())], [bogus]
    if kind == "duplicate_name":
        return chunk + [(name, tensor), (name, tensor.clone())], [name]
    if kind == "expert_out_of_range":
        bogus = f"model.layers.0.mlp.experts.{spec.num_experts}.gate_proj.weight"
        gate = torch.zeros(spec.hf_shape("gate"), dtype=spec.dtype)
        return chunk + [(name, tensor), (bogus, gate)], [bogus]
    if kind == "missing_expert":
        from reference_impl.layout import parse_receiver_name

        expert = parse_receiver_name(name).expert
        return chunk, ["expert", str(expert)]
    raise ValueError(f"unknown bad-input kind {kind!r}")


BAD_INPUT = [(kind, fmt) for fmt in ch.FORMATS
             for kind in ("wrong_dtype", "wrong_shape", "unknown_name", "duplicate_name")]
BAD_INPUT += [("expert_out_of_range", "compat"), ("missing_expert", "compat")]


@pytest.mark.weightsync_property("rejects_bad_input")
@pytest.mark.parametrize("kind,payload_format", [pytest.param(k, f, id=f"{f}-{k}")
                                                 for k, f in BAD_INPUT])
@pytest.mark.parametrize("case", ANCHORS[:3])
def test_loader_rejects_bad_input_and_writes_nothing(weightsync_loader, case, payload_format,
                                                     kind):
    _require_claim(weightsync_loader, case, payload_format)
    for rank in range(case.receiver.world_size):
        params = ch.receiver_params(case, rank)
        before = compare.snapshot(params)
        chunk, words = _bad_payload(kind, payload_format, case, rank)
        with pytest.raises((ValueError, TypeError)) as info:
            weightsync_loader.load_weights(params, chunk, format=payload_format, spec=case.spec,
                                           topology=case.receiver, rank=rank)
        message = str(info.value).lower()
        missing = [w for w in words if w.lower() not in message]
        assert not missing, (f"{weightsync_loader.name} refused a {kind} payload on receiver rank "
                             f"{rank}, but its error does not name the problem (lacks {missing}): "
                             f"{type(info.value).__name__}: {info.value}")
        try:
            compare.assert_unchanged(before, params, locate=ch.harness.locator(case, rank),
                                     rank=rank)
        except AssertionError as error:
            raise ch.ConformanceError(f"refused a {kind} payload but had already written "
                                      f"part of it:\n{error}") from None


# --- fallback ----------------------------------------------------------------------------------


@pytest.mark.weightsync_property("fallback_routing")
@pytest.mark.parametrize("restriction", sorted(ch.RESTRICTIONS))
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_fallback_path_lands_bit_exact(weightsync_loader, case, restriction):
    choice = ch.fallback_choice(weightsync_loader, "loader", case, restriction)
    for rank in range(case.receiver.world_size):
        params = ch.receiver_params(case, rank)
        before = compare.snapshot(params)
        ch.load(weightsync_loader, params, choice.path, case, rank, version=4)
        ch.check_rank(params, case, rank, 4, before)
