"""The reference receiver as the judge of senders' streams, and as the suites' own receiver.

An exporter's stream (and every stream the self-tests send) is loaded bucket by bucket into a
fresh, poisoned :class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` of the
engine rank it is for - ``begin_update()``, ``load(bucket)`` per bucket, ``end_update()`` -
which refuses anything a strict engine would (names, shapes, dtypes, completeness), and the
rank is then judged bit for bit (:func:`suites.harness.judge.check_rank`).
"""

from __future__ import annotations

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.vocabulary import LOAD_FORMAT

from . import inputs, judge


def fresh_receiver(case, rank):
    """A reference receiver of engine ``rank``, every buffer poisoned."""
    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

    receiver = ReferenceReceiver(case.spec, case.receiver, rank)
    for tensor in receiver.params.values():
        synth.poison_(tensor)
    return receiver


def load_update(receiver, stream, fmt) -> None:
    """One framed update of ``stream`` into ``receiver``."""
    receiver.begin_update()
    for bucket in stream:
        receiver.load(list(bucket), load_format=LOAD_FORMAT[fmt])
    receiver.end_update()


def judge_stream(case, rank, stream, fmt, version, head: str, previous_version=None):
    """Load ``stream`` into a fresh reference receiver of ``rank`` and judge it against
    ``version``; raise :class:`~suites.harness.judge.ConformanceError` starting with ``head``
    when the receiver refuses it or the result differs (a result equal to
    ``previous_version``'s values is named stale). Returns the receiver."""
    from pytest_weightsync.reference_impl.model.layout import WeightSyncError

    receiver = fresh_receiver(case, rank)
    before = compare.snapshot(receiver.params)
    try:
        load_update(receiver, stream, fmt)
    except WeightSyncError as error:
        raise judge.ConformanceError(f"{head}: the reference receiver refused the stream: "
                                     f"{judge.quoted(error)}") from None
    try:
        judge.check_rank(receiver.params, case, rank, version, before,
                         previous_version=previous_version, side="exporter")
    except AssertionError as error:
        raise judge.ConformanceError(f"{head}:\n{error}", getattr(error, "mismatch", None)) \
            from None
    return receiver


def sync_and_check(case, fmt, version, receivers=None, full=None, bucket=inputs.DEFAULT_BUCKET):
    """Send ``version`` in ``fmt`` to every receiver rank (reference receivers) as a framed
    bucket stream cut at ``bucket``, then check every rank. Returns the receivers for further
    updates. The self-tests that use it plant bugs in the sender or the receiver, so a named
    pattern may blame either side."""
    receivers = inputs.fresh_receivers(case) if receivers is None else receivers
    full = inputs.gathered_weights(case, version) if full is None else full
    for rec in receivers:
        before = compare.snapshot(rec.params)
        load_update(rec, inputs.stream(fmt, case, rec.rank, version, bucket=bucket, full=full), fmt)
        judge.check_rank(rec.params, case, rec.rank, version, before, cached=False, side=None)
    return receivers


def check_receiver(receiver, case, version, before=None):
    """:func:`suites.harness.judge.check_rank` of a reference receiver (the expected state
    computed afresh: the self-tests that use it plant bugs in what computes it)."""
    judge.check_rank(receiver.params, case, receiver.rank, version, before, cached=False,
                     side=None)
