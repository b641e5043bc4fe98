"""Whole-model refit conformance: every parameter of a real MoE model, written once, bit for bit.

Runs for loaders and (single-process) exporters that claim whole models
(``Capabilities.model_parts`` / ``targets``); an expert-only implementation skips every case
here as not claimed. The cases (``suites/harness/model_cases.py``) are Qwen3-MoE and
Qwen3.5-MoE models - attention with fewer KV heads than TP ranks, GDN layers, shared experts,
routers (bf16 and float32) and the float32 expert bias, norms, vocab-padded embeddings, tied
and untied ``lm_head``, an MTP draft - on engines of TP 1, 2 and 4 and trainers with PP 2.

- ``coverage``: every engine parameter poisoned, one update, then every one compared: the
  report (``suites/harness/coverage.py``) names a parameter never written, written from
  another layer or source, cast through bf16, split evenly across TP, with its first wrong
  element (parameter, layer, row, col). Exporters' streams are judged first: every tensor the
  update owes carried exactly once, in its dtype;
- ``model_bit_exact``: a second version after a first into the same buffers (every element
  differs between versions, so a stale value shows); exporters re-export after the trainer's
  tensors changed in place;
- ``tied_embeddings``: a tied model's one source reaches both views, after each update
  (exporters: the stream carries the embedding once);
- ``targets``: the draft (MTP) model updated when the update reaches it; a frozen draft
  bit-identical (exporters: every draft tensor in the stream).

Formats: :data:`~pytest_weightsync.vocabulary.MODEL_FORMATS` (``packed`` names only experts).
"""

from __future__ import annotations

import pytest

from pytest_weightsync import compare
from pytest_weightsync.vocabulary import BUCKET_LIMITS, MODEL_FORMATS as FORMATS

from ..harness import claims, coverage, judge, model_cases, model_inputs, stream_coverage
from ..harness import exporter as exporter_harness

CASES = model_cases.model_case_params()
#: Exporters export what the trainer holds: every target of the model.
EXPORT_CASES = model_cases.model_case_params(where=lambda c: not c.frozen)
TIED = model_cases.model_case_params(where=lambda c: c.spec.tied)
EXPORT_TIED = model_cases.model_case_params(where=lambda c: c.spec.tied and not c.frozen)
#: One case with the draft updated, one with it frozen.
DRAFT = model_cases.model_case_params(
    where=lambda c: c.spec.mtp_layers and (c.frozen or c.receiver.tp == 1))
EXPORT_DRAFT = model_cases.model_case_params(where=lambda c: c.spec.mtp_layers and not c.frozen)


def _limit(turn: int) -> str:
    return BUCKET_LIMITS[turn % len(BUCKET_LIMITS)]


def _updated(weightsync_loader, case, fmt, version, rank, params=None):
    params = model_inputs.engine_params(case, rank) if params is None else params
    before = compare.snapshot(params)
    model_inputs.load(weightsync_loader, params, fmt, case, rank, version, bucket=_limit(rank + version))
    return params, before


# --- loaders ----------------------------------------------------------------------------------


def _claimed_ranks(loader, case, fmt) -> range:
    """The engine ranks of ``case`` once ``loader`` claims it in ``fmt`` (else skipped)."""
    claims.require_model_claim(loader, "loader", case, fmt)
    return range(case.receiver.tp)


@pytest.mark.weightsync_property("coverage")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_loader_writes_every_parameter_from_its_source(weightsync_loader, case, payload_format):
    for rank in _claimed_ranks(weightsync_loader, case, payload_format):
        params, before = _updated(weightsync_loader, case, payload_format, 1, rank)
        coverage.check_model_rank(params, case, rank, 1, before)


@pytest.mark.weightsync_property("model_bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_loader_second_version_lands_bit_exact_in_place(weightsync_loader, case, payload_format):
    for rank in _claimed_ranks(weightsync_loader, case, payload_format):
        params, first = _updated(weightsync_loader, case, payload_format, 1, rank)
        params, before = _updated(weightsync_loader, case, payload_format, 2, rank, params)
        compare.assert_same_storage(first, params, rank=rank)
        coverage.check_model_rank(params, case, rank, 2, before, previous_version=1,
                                  prop="model_bit_exact")


@pytest.mark.weightsync_property("tied_embeddings")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", TIED)
def test_loader_tied_embedding_reaches_both_views(weightsync_loader, case, payload_format):
    """One source (the checkpoint's ``model.embed_tokens.weight``; direct: both engine
    tensors from it); after each of two updates ``lm_head`` equals ``embed_tokens``."""
    claims.require_model_claim(weightsync_loader, "loader", case, payload_format)
    for rank in range(case.receiver.tp):
        params = None
        for version in (1, 2):
            params, _ = _updated(weightsync_loader, case, payload_format, version, rank, params)
            embed, head = params["model.embed_tokens.weight"], params["lm_head.weight"]
            if not compare.same_bits(head, embed):
                expected = model_inputs.expected(case, rank, version)["lm_head.weight"]
                where = ("lm_head.weight never reached version "
                         f"{version}" if not compare.same_bits(head, expected) else
                         "model.embed_tokens.weight is wrong")
                try:
                    compare.assert_bitwise_equal(head, embed, name="lm_head.weight",
                                                 locate=coverage.locator(case, rank), rank=rank)
                except compare.BitMismatchError as error:
                    raise judge.ConformanceError(f"tied lm_head not updated ({where}): the two "
                                                 f"views of the one embedding differ\n{error}") from None


@pytest.mark.weightsync_property("targets")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", DRAFT)
def test_loader_updates_the_draft_when_reached_and_leaves_a_frozen_one(weightsync_loader, case,
                                                                       payload_format):
    claims.require_model_claim(weightsync_loader, "loader", case, payload_format)
    from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX

    for rank in range(case.receiver.tp):
        params, before = _updated(weightsync_loader, case, payload_format, 1, rank)
        findings = [f for f in coverage.state_findings(params, case, rank, 1, before)
                    if f.param.startswith(DRAFT_PREFIX)]
        if findings:
            raise judge.ConformanceError(coverage.report(case, rank, findings, "draft (MTP) "))


# --- exporters --------------------------------------------------------------------------------


def _exports(exporter, case, fmt, version=1):
    """The trainer states of ``version`` and the streams ``exporter`` makes of them, once it
    claims ``case`` in ``fmt`` (else skipped)."""
    claims.require_model_claim(exporter, "exporter", case, fmt)
    states = model_inputs.trainer_states(case, version)
    return states, exporter_harness.exported_streams(exporter, case, fmt, states)


@pytest.mark.weightsync_property("coverage")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", EXPORT_CASES)
def test_exporter_stream_carries_every_parameter_once(weightsync_exporter, case, payload_format):
    _, exports = _exports(weightsync_exporter, case, payload_format)
    for rank, stream in exports:
        stream_coverage.judge_model_stream(case, rank, stream, payload_format, 1,
                                           f"{payload_format} stream of "
                                           f"{weightsync_exporter.name}")


@pytest.mark.weightsync_property("model_bit_exact")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", EXPORT_CASES)
def test_exporter_second_version_after_in_place_change(weightsync_exporter, case, payload_format):
    """The trainer's tensors change in place (every element) between two exports: the
    second stream must carry the second version."""
    import torch

    states, exports = _exports(weightsync_exporter, case, payload_format)
    for _ in exports:  # the first version's streams (judged by the coverage test)
        pass
    changed = model_inputs.trainer_states(case, 2)
    with torch.no_grad():
        for state, new in zip(states, changed):
            for name, tensor in state.items():
                tensor.copy_(new[name])
    for rank, stream in exporter_harness.exported_streams(weightsync_exporter, case,
                                                          payload_format, states):
        stream_coverage.judge_model_stream(case, rank, stream, payload_format, 2,
                                           f"second version ({payload_format}, "
                                           f"{weightsync_exporter.name})", previous_version=1,
                                           prop="model_bit_exact")


@pytest.mark.weightsync_property("tied_embeddings")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", EXPORT_TIED)
def test_exporter_sends_the_tied_embedding_once(weightsync_exporter, case, payload_format):
    """Checkpoint formats: ``model.embed_tokens.weight`` once, no ``lm_head.weight`` (with PP
    > 1 the last stage's copy of the embedding is not a second source); direct: both engine
    tensors, equal."""
    _, exports = _exports(weightsync_exporter, case, payload_format)
    for rank, stream in exports:
        problem = stream_coverage.tied_stream_problem(rank, stream, payload_format)
        if problem is not None:
            raise judge.ConformanceError(problem)


@pytest.mark.weightsync_property("targets")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", EXPORT_DRAFT)
def test_exporter_sends_the_draft(weightsync_exporter, case, payload_format):
    """The trainer's MTP block reaches the draft: every ``mtp.*`` (direct: ``draft.*``) tensor."""
    _, exports = _exports(weightsync_exporter, case, payload_format)
    for rank, stream in exports:
        problem = stream_coverage.draft_stream_problem(case, rank, stream, payload_format)
        if problem is not None:
            raise judge.ConformanceError(problem)