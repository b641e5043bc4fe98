"""Every registered loader and exporter on Hypothesis-drawn topologies and bucket limits.

The fixed matrix (``suites.harness.cases.CASES``) is a pairwise cover of a few factor values; a bug that
shows only at one size combination (a square per-rank block where a transposition keeps the
shape, an odd intermediate, one local expert too many) can fall between its rows. Here
``cases.cases()`` draws topologies freely - sizes included - and every implementation the
registry hands out runs on them through the same ``conformance_harness`` load-and-check as
the fixed suites:

- ``bit_exact`` (loaders): a full update of a drawn format, cut into buckets at a drawn limit
  (one tensor per bucket, a few hundred bytes, a whole update, or a named harness limit),
  checked bit for bit on up to two drawn receiver ranks;
- ``export_bit_exact`` (exporters): the exporter's payload for up to two drawn receiver ranks,
  loaded by the reference receiver and checked bit for bit.

A draw the implementation does not claim (capabilities) is not run; a test where no draw was
claimed skips with the reason of the last refusal. The example count is small and fixed
(``derandomize``: the same draws every run, so CI is stable), the time budget a few seconds
per implementation.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_weightsync import compare
from pytest_weightsync.vocabulary import BUCKET_LIMITS as NAMED_LIMITS
from pytest_weightsync.vocabulary import FORMATS

from ..harness import cases, claims, exporter, inputs, judge, loader

#: Few, reproducible examples: this file stays within a few seconds per implementation.
PROFILE = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                   report_multiple_bugs=False,
                   suppress_health_check=list(HealthCheck))

#: Bucket limits drawn for a loader's stream (bytes, a harness name, or ``None``: one bucket).
BUCKET_LIMITS = st.one_of(st.just(None), st.just(0), st.integers(1, 2048),
                          st.sampled_from(NAMED_LIMITS))


def _ranks(data, case):
    """Up to two distinct receiver ranks, the last one always among them (uneven splits and
    the highest expert range live there)."""
    world = case.receiver.world_size
    other = data.draw(st.integers(0, world - 1), label="rank")
    return sorted({world - 1, other})


class _Draws:
    """The claim bookkeeping both tests share: a draw ``impl`` does not claim as ``role`` is not
    run (its reason is kept), and a test where no draw was claimed skips with the last reason."""

    def __init__(self, impl, role: str):
        self.impl, self.role, self.refusals, self.ran = impl, role, [], []

    def claimed(self, case, fmt) -> bool:
        reason = claims.unclaimed(self.impl, self.role, case, fmt)
        if reason is not None:
            self.refusals.append(reason)
            return False
        self.ran.append(case.id)
        return True

    def skip_if_none_claimed(self) -> None:
        if not self.ran:
            claims.skip_unclaimed(self.refusals[-1] if self.refusals else "no draw was claimed")


@contextlib.contextmanager
def _judged(draw: str):
    """A failed check becomes the :class:`ConformanceError` the report shows, led by the draw
    (Hypothesis reproduces it from the same draw)."""
    try:
        yield
    except AssertionError as error:
        raise judge.ConformanceError(f"{draw}:\n{error}") from None


@pytest.mark.weightsync_property("bit_exact")
def test_loader_on_drawn_topologies_and_buckets(weightsync_loader):
    impl, draws = weightsync_loader, _Draws(weightsync_loader, "loader")

    @PROFILE
    @given(case=cases.cases(), fmt=st.sampled_from(FORMATS), limit=BUCKET_LIMITS,
           data=st.data())
    def run(case, fmt, limit, data):
        if not draws.claimed(case, fmt):
            return
        for rank in _ranks(data, case):
            params = inputs.receiver_params(case, rank)
            before = compare.snapshot(params)
            with _judged(f"{case.id} format={fmt} bucket_bytes={limit!r} receiver rank {rank}"):
                loader.load(impl, params, fmt, case, rank, version=1, bucket=limit)
                judge.check_rank(params, case, rank, 1, before)

    run()
    draws.skip_if_none_claimed()


@pytest.mark.weightsync_property("export_bit_exact")
def test_exporter_on_drawn_topologies(weightsync_exporter):
    impl, draws = weightsync_exporter, _Draws(weightsync_exporter, "exporter")

    @PROFILE
    @given(case=cases.cases(), fmt=st.sampled_from(FORMATS), data=st.data())
    def run(case, fmt, data):
        if not draws.claimed(case, fmt):
            return
        with _judged(f"{case.id} trainer={case.trainer} format={fmt}"):
            exporter.export_and_check(impl, case, fmt, 1, ranks=_ranks(data, case))

    run()
    draws.skip_if_none_claimed()
