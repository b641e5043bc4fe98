"""Whole-model conformance of distributed exporters, in real Megatron trainer ranks.

Runs for implementations that claim the ``distributed_exporter`` role AND whole models
(``Capabilities.model_parts``; an expert-only exporter skips every case as not claimed). Each
case (``suites.harness.model_distributed.MODEL_DIST_CASES``: every trainer topology of the
distributed expert matrix - TP 1, 2, 4, EP 1, 2, 4, ETP 1, 2, both expert modules - and PP 2
even and uneven, 2 + 1 layers; both deliveries; float32 router and expert bias; tied and
untied embeddings; shared experts; MTP drafts; a GDN layer, its mixer modelled) runs in :data:`~suites.harness.
model_distributed.WORLD` gloo ranks, each holding a real megatron-core ``GPTModel`` of its
stage with every parameter set from the trainer oracle; the exporter is called once per
claimed format, each call after the next version was written in place, the first format
again at the end. One run serves the properties below:

- ``coverage``: the first update's streams: every tensor owed carried exactly once in its
  dtype, and after loading into a fully poisoned reference receiver - and into every stock
  SGLang row that claims the model - every engine parameter holds its value (a stage-local layer name is "written twice" / "never written", with the
  pattern named; a float32 router cut to bf16 is named);
- ``model_bit_exact``: every later update bit-exact, a value of the previous version named
  stale;
- ``tied_embeddings``: a tied model's one source in every stream of every update (with PP > 1
  the last stage's copy of the embedding is not a second source);
- ``targets``: the trainer's MTP block (megatron-core's own ``MultiTokenPredictionBlock`` on
  the last stage) reaches the draft in every stream of every update, whole.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import MODEL_FORMATS as FORMATS

from ..harness import claims
from ..harness import model_distributed as md

CASES = md.model_dist_params()
TIED = md.model_dist_params(where=lambda c: c.case.spec.tied)
DRAFT = md.model_dist_params(where=lambda c: c.case.spec.mtp_layers)


def _run(exporter, mcase, rank_pool):
    md.require_claim(exporter, mcase)
    formats = claims.claimed_formats(exporter, "distributed_exporter", mcase.case, FORMATS)
    if not formats:
        claims.skip_unclaimed(f"{exporter.name} claims none of {FORMATS} for this receiver")
    return md.run(rank_pool, exporter, mcase, formats)


@pytest.mark.weightsync_property("coverage")
@pytest.mark.parametrize("mcase", CASES)
def test_distributed_model_stream_covers_every_parameter(weightsync_distributed_exporter,
                                                         mcase, rank_pool):
    result = _run(weightsync_distributed_exporter, mcase, rank_pool)
    assert md.judge_update(result, 0)


@pytest.mark.weightsync_property("model_bit_exact")
@pytest.mark.parametrize("mcase", CASES)
def test_distributed_model_later_versions_land_bit_exact(weightsync_distributed_exporter,
                                                         mcase, rank_pool):
    result = _run(weightsync_distributed_exporter, mcase, rank_pool)
    for index in range(1, len(result.updates)):
        assert md.judge_update(result, index)


@pytest.mark.weightsync_property("tied_embeddings")
@pytest.mark.parametrize("mcase", TIED)
def test_distributed_model_sends_the_tied_embedding_once(weightsync_distributed_exporter,
                                                         mcase, rank_pool):
    md.check_tied(_run(weightsync_distributed_exporter, mcase, rank_pool))


@pytest.mark.weightsync_property("targets")
@pytest.mark.parametrize("mcase", DRAFT)
def test_distributed_model_sends_the_draft(weightsync_distributed_exporter, mcase, rank_pool):
    md.check_draft(_run(weightsync_distributed_exporter, mcase, rank_pool))
