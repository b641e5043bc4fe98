"""Conformance of every registered loader (``load_weights``) to the reference, bit for bit.

Each test runs once per registered implementation with a loader role (``weightsync_loader``,
the test id carries its name) and states one property:

- ``bit_exact``: every format it claims, on every topology of the matrix it claims, leaves
  every receiver rank's expert parameters equal to the expected state in every bit. Each
  update is a bucket stream framed by the loader's optional ``begin_update``/``end_update``;
  receiver ranks take turns through the bucket limits (one tensor per bucket, a layer's
  experts split over buckets, several layers in a bucket, the whole update), so every case
  sees several of them. A loader that claims the ``flattened_bucket`` transport also gets
  each bucket as SGLang's flattened bucket (``docs/transports.md``), its buffer refilled
  after each load;
- ``in_place``: a payload of one layer writes that layer at unchanged addresses and leaves
  every other parameter (other layers, the router weight) bit-identical. Every bucket is
  inside a session: a loader with ``begin_update``/``end_update`` gets the layer as the last
  buckets of a full update whose other layers carry the bits they hold (so a loader that
  refuses ``load_weights`` outside a session, as vLLM's worker does, is judged too); one
  without hooks gets the layer alone;
- ``no_stale_values``: three successive versions into the same buffers, each fully visible,
  each cut at a different bucket limit, each bucket's tensors refilled by the harness as soon
  as ``load_weights`` returns (as real senders reuse their buffer): a loader that keeps
  references and copies later fails, named "deferred copy";
- ``hardening`` (a report, not a verdict): each bad kind SGLang users hit (float32, a short
  ``down_proj``, an unknown name, an out-of-range expert, duplicates within and across buckets,
  a missing expert) at the end of a valid update; what the loader did is recorded as a finding
  (``suites/harness/hardening.py``). Only refusing a bucket after writing part of it fails;
- ``fallback_routing``: with a capability taken away, ``pytest_weightsync.reference_impl.senders.select`` routes the
  update down a path the loader claims, and that path lands bit-exact too;
- ``engine_layout``: receivers as engines hold them (``cases.ENGINE_CASES``: the TRT-LLM BF16
  block layout applied after every update, triton_kernels' transposed parameters, redundant
  expert copies under a placement that changes between updates): three framed updates, each
  checked bit for bit in the engine's layout, every physical copy included. A loader that
  does not claim an engine layout (``Capabilities.engine_layouts`` / ``redundant_experts``)
  is not run on it. FP8 block-quantized engines (``cases.FP8_CASES``): three updates, weights
  and block scales bit-exact against the reference quantizer when the sender quantizes, the
  dequantized values within one FP8 unit when the loader does (``Capabilities.weight_quants``
  / ``quantizers``).

What an implementation does not claim is skipped with the reason - never passed.
"""

from __future__ import annotations

import pytest

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model.layout import fused_name
from pytest_weightsync.vocabulary import BUCKET_LIMITS, FORMATS

from ..harness import cases, claims, hardening, inputs, judge, loader, quant_judge

#: The hand-picked cases, plus one of realistic size (``cases.REALISTIC``, 36 MiB an update).
ANCHORS = [pytest.param(case, id=case.id) for case in (*cases.ANCHORS, cases.REALISTIC)]
ENGINES = [pytest.param(case, id=case.id) for case in cases.ENGINE_CASES]
FP8 = [pytest.param(case, id=case.id) for case in cases.FP8_CASES]


def _require_claim(impl, case, fmt=None):
    claims.require_claim(impl, "loader", case, fmt)


def _limit(turn: int) -> str:
    """The bucket limit of a turn (a rank, a version): all of them in rotation."""
    return BUCKET_LIMITS[turn % len(BUCKET_LIMITS)]


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
def test_loader_lands_bit_exact_on_every_rank(weightsync_loader, moe_case, payload_format):
    _require_claim(weightsync_loader, moe_case, payload_format)
    for rank in range(moe_case.receiver.world_size):
        params = inputs.receiver_params(moe_case, rank)
        before = compare.snapshot(params)
        loader.load(weightsync_loader, params, payload_format, moe_case, rank, version=1,
                    bucket=_limit(rank))
        judge.check_rank(params, moe_case, rank, 1, before)


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
def test_loader_lands_a_realistic_update_in_one_bucket(weightsync_loader, payload_format):
    """The whole 36 MiB update in one bucket: what only size shows (a fixed staging buffer
    that drops the tail, offsets that overflow) cannot hide behind the matrix's small cases."""
    case = cases.REALISTIC
    _require_claim(weightsync_loader, case, payload_format)
    params = inputs.receiver_params(case, 0)
    before = compare.snapshot(params)
    loader.load(weightsync_loader, params, payload_format, case, 0, version=1, bucket="whole")
    judge.check_rank(params, case, 0, 1, before)


@pytest.mark.gpu
@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
def test_loader_lands_a_qwen35_layer_on_the_gpu(weightsync_loader, payload_format):
    """One real Qwen3.5-35B-A3B layer (1.5 GiB), parameters and payload on the GPU, in one
    bucket; the expected state is built on the device and compared there."""
    import torch

    from pytest_weightsync.reference_impl.senders import formats as senders
    from pytest_weightsync.reference_impl.oracle import synth

    case = cases.QWEN35_LAYER
    _require_claim(weightsync_loader, case, payload_format)
    spec, receiver = case.spec, case.receiver
    params = inputs.receiver_params(case, 0, device="cuda")
    before = compare.snapshot(params)
    full = synth.full_weights(spec, 1, device="cuda")
    payload = senders.export(payload_format, spec, receiver, 0, full)
    del full
    loader.load_stream(weightsync_loader, params, [payload], payload_format, case, 0)
    torch.cuda.synchronize()
    del payload
    expected = synth.expected_receiver_params(spec, receiver, 0, 1, device="cuda")
    compare.assert_same_storage(before, params, rank=0)
    for name, want in expected.items():
        compare.assert_bitwise_equal(params[name], want, name=name, rank=0,
                                     locate=inputs.locator(case, 0))
    for name, record in before.records.items():
        if name not in expected:
            compare.assert_bitwise_equal(params[name], record.copy, name=name, rank=0)


@pytest.mark.weightsync_property("in_place")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_writes_in_place_and_only_the_payload(weightsync_loader, case, payload_format):
    """A loader with hooks gets the layer inside a session (``loader.load_part``): after a
    full update of version 1, the last buckets of an update whose other layers carry version 1
    again; without hooks, the layer's buckets alone."""
    _require_claim(weightsync_loader, case, payload_format)
    layer = case.spec.num_layers - 1
    framed = loader.frames_updates(weightsync_loader)
    for rank in range(case.receiver.world_size):
        params = inputs.receiver_params(case, rank)
        if framed:
            loader.load(weightsync_loader, params, payload_format, case, rank, version=1)
        before = compare.snapshot(params)
        loader.load_part(weightsync_loader, params, payload_format, case, rank, 2, [layer],
                         held_version=1)
        judge.check_rank(params, case, rank, 2, before,
                         touched=[fused_name(layer, "w13"), fused_name(layer, "w2")],
                         previous_version=1 if framed else None)


@pytest.mark.weightsync_property("no_stale_values")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_repeated_updates_leave_no_stale_value(weightsync_loader, case, payload_format):
    """Versions differ in every element, so any element a later update misses shows; the
    buckets are refilled after each load returns, so a deferred copy shows too."""
    _require_claim(weightsync_loader, case, payload_format)
    for rank in range(case.receiver.world_size):
        params = inputs.receiver_params(case, rank)
        before = compare.snapshot(params)
        for version in (1, 2, 3):
            loader.load_and_check(weightsync_loader, params, payload_format, case, rank, version,
                                  before=before, bucket=_limit(rank + version),
                                  previous_version=version - 1 if version > 1 else None)


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", ANCHORS[:3])
def test_loader_flattened_buckets_land_bit_exact(weightsync_loader, case, payload_format):
    """For loaders that claim the ``flattened_bucket`` transport: two updates, each bucket
    handed over as SGLang's flattened bucket (one uint8 tensor of mixed dtypes, aligned
    offsets, ``FlattenedTensorMetadata``), its flat buffer refilled as soon as the load
    returns (a real sender reuses it for the next bucket)."""
    _require_claim(weightsync_loader, case, payload_format)
    reason = weightsync_loader.capabilities.transport_refusal("flattened_bucket")
    if reason is not None:
        claims.skip_unclaimed(f"{weightsync_loader.name} {reason}")
    for rank in range(case.receiver.world_size):
        params = inputs.receiver_params(case, rank)
        before = compare.snapshot(params)
        for version in (1, 2):
            loader.load_and_check(weightsync_loader, params, payload_format, case, rank, version,
                                  before=before, bucket=_limit(rank + version),
                                  previous_version=version - 1 if version > 1 else None,
                                  transport="flattened_bucket")


# --- hardening (bad input: a report, never a verdict) -------------------------------------------


@pytest.mark.weightsync_property("hardening")
@pytest.mark.parametrize("kind", hardening.KINDS)
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("topology_class", sorted(hardening.CLASSES))
def test_loader_hardening_probe(weightsync_loader, topology_class, payload_format, kind,
                                weightsync_record_property):
    """Feed one bad kind at the end of a valid update and record what the loader did (see
    ``suites/harness/hardening.py``). Leniency never fails this test; refusing a bucket after it had
    written part of it does (atomicity)."""
    case, why_not = hardening.case_for(weightsync_loader, topology_class, payload_format)
    if case is None:
        claims.skip_unclaimed(why_not)
    rank = case.receiver.world_size - 1
    weightsync_record_property("weightsync_topology", case.id)
    finding, _ = hardening.probe(weightsync_loader, kind, payload_format, case, rank)
    weightsync_record_property("weightsync_bad_kind", kind)
    weightsync_record_property("weightsync_finding", finding.key)
    weightsync_record_property("weightsync_finding_detail", finding.detail)
    if finding.outcome in hardening.FAILING:
        raise judge.ConformanceError(
            f"{weightsync_loader.name} refused a {kind} {payload_format} bucket on receiver rank "
            f"{rank} of {case.id} but had already written part of it (a refused bucket must "
            f"write nothing): {finding.detail}")


# --- fallback ----------------------------------------------------------------------------------


@pytest.mark.weightsync_property("fallback_routing")
@pytest.mark.parametrize("restriction", sorted(claims.RESTRICTIONS))
@pytest.mark.parametrize("case", ANCHORS)
def test_loader_fallback_path_lands_bit_exact(weightsync_loader, case, restriction):
    choice = claims.fallback_choice(weightsync_loader, "loader", case, restriction)
    for rank in range(case.receiver.world_size):
        params = inputs.receiver_params(case, rank)
        before = compare.snapshot(params)
        loader.load(weightsync_loader, params, choice.path, case, rank, version=4)
        judge.check_rank(params, case, rank, 4, before)


# --- engines: layouts after loading, redundant experts ------------------------------------------


@pytest.mark.weightsync_property("engine_layout")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", ENGINES)
def test_loader_engine_layout_holds_after_every_update(weightsync_loader, case, payload_format):
    """Three updates into the same buffers, each a framed bucket stream at another limit; after
    each, every rank holds the new version in the engine's layout. An EPLB engine is rebalanced
    before the second and third update (weights moved to the new placement, as the engine's
    expert location updater does) and the loader gets the new placement's topology."""
    updates = cases.engine_updates(case)
    for _, update in updates:
        _require_claim(weightsync_loader, update, payload_format)
    world = case.receiver.world_size
    params = [inputs.receiver_params(case, rank) for rank in range(world)]
    before = [compare.snapshot(p) for p in params]
    previous = None
    for version, update in updates:
        if previous is not None and update.receiver != previous.receiver:
            inputs.rebalance(params, case.spec, previous.receiver, update.receiver)
        for rank in range(world):
            loader.load(weightsync_loader, params[rank], payload_format, update, rank, version,
                        bucket=_limit(rank + version))
            judge.check_rank(params[rank], update, rank, version, before[rank],
                             previous_version=version - 1 if version > 1 else None)
        previous = update


@pytest.mark.weightsync_property("engine_layout")
@pytest.mark.parametrize("quantizer, payload_format",
                         [("sender", "compat"), ("sender", "direct"), ("loader", "compat")])
@pytest.mark.parametrize("case", FP8)
def test_loader_fp8_block_weights_and_scales_after_every_update(weightsync_loader, case,
                                                                quantizer, payload_format):
    """Three updates into an FP8 block-quantized engine, each a framed bucket stream (weights
    and their scales may travel in different buckets). Sender-quantized: every weight and
    every block scale bit-exact against the reference quantizer, each scale beside its own
    block. Loader-quantized: every weight read with its scales within one FP8 unit of the
    reference, its scales rebuilt from each update's weights."""
    _require_claim(weightsync_loader, case, payload_format)
    reason = weightsync_loader.capabilities.quantizer_refusal(quantizer)
    if reason is not None:
        claims.skip_unclaimed(f"{weightsync_loader.name} {reason}")
    for rank in range(case.receiver.world_size):
        params = inputs.receiver_params(case, rank)
        before = compare.snapshot(params)
        for version in (1, 2, 3):
            stream = inputs.fp8_stream(payload_format, case, rank, version, quantizer,
                                       bucket=_limit(rank + version))
            loader.load_stream(weightsync_loader, params, stream, payload_format, case, rank)
            if quantizer == "sender":
                judge.check_rank(params, case, rank, version, before,
                                 previous_version=version - 1 if version > 1 else None)
            else:
                quant_judge.check_dequantized(params, case, rank, version, before,
                                              previous_version=version - 1 if version > 1
                                              else None)
