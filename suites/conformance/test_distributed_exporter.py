"""Conformance of every registered distributed exporter (``export_weights_distributed``).

Each test runs once per registered implementation with that role, in real gloo ranks (4 for
every built-in case, so one warm pool serves them) with Megatron-Core's ``parallel_state``
initialized for the case's trainer topology and the rank's model built as
``megatron.training.get_model`` builds it (DDP-wrapped ``GPTModel`` chunks). The exporter does
its own collectives; its streams come back and are loaded by the reference receiver of the
engine rank they were sent to, which is judged bit for bit against the independent oracle -
and, where SGLang imports, by every stock SGLang row that claims the format and receiver.

- ``distributed_export_bit_exact``: the distributed cases (``suites.harness.cases.DIST_CASES``
  plus every extra topology a plugin adds): >= 2 experts per EP rank on both sides, ETP 2 for
  every (expert module, delivery) pair, trainer and engine EP sizes that differ, TP 1-4, PP
  1-2, bucketed and whole streams; every format the exporter claims, each update a new version
  of the trainer parameters written in place (a stale result is named); after EVERY exporter
  call each rank checks that its trainer parameters are bit-identical and on the same storage
  (the failure names the call, rank, parameter, row, col - or "rebound").

  Buckets may travel on any transport (``pytest_weightsync.wire``: pairs, flattened buckets,
  serialized updates with one entry per engine TP rank; or broadcasts to the engine ranks of
  ``pytest_weightsync.transports.broadcast``): each is decoded by the harness's own decoder into what the
  engine rank reads, and a bucket no engine could decode fails naming bucket and entry. Each
  test records the transports used (``weightsync_transports``).

  Buckets that exceed ``bucket_bytes`` by more than one unit (the tensors converted from one
  source parameter) do not fail the test: each test records a ``bucket_limit`` finding
  (``within`` or ``over``, with the first offending bucket), reported in its own column.
"""

from __future__ import annotations

import pytest

from ..harness import claims
from ..harness import distributed as dh


@pytest.mark.weightsync_property("distributed_export_bit_exact")
def test_distributed_exporter_streams_land_bit_exact(weightsync_distributed_exporter, dcase,
                                                      rank_pool, weightsync_record_property):
    exporter = weightsync_distributed_exporter
    dh.require_claim(exporter, dcase)
    formats = claims.claimed_formats(exporter, "distributed_exporter", dcase.case, dh.FORMATS)
    if not formats:
        claims.skip_unclaimed(f"{exporter.name} claims none of {dh.FORMATS} for this receiver")
    dh.require_megatron()
    result = dh.run_and_judge(rank_pool, exporter, dcase, formats)
    dh.record_bucket_limit(weightsync_record_property, dcase, result)
    weightsync_record_property("weightsync_transports", " ".join(sorted(result.transports)))
    assert result.formats == set(formats)
