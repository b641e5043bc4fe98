"""``atomic_update`` and ``lifecycle`` (sessions): an update that fails, misuse of the session.

``atomic_update``
    An update that fails mid-stream (:data:`FAILURES`: a refused bucket, an exception in the
    sender, a lost rank) leaves the old version bit for bit or the engine marked unusable
    (``end_update`` refuses to complete it, or ``weight_version`` is ``None``) - never a silent
    mix, never a version moved; the next full update is bit-exact (tokenspeed#672,
    NeMo-RL#2444). A lost rank's update is judged while its session is still open, then
    abandoned the documented way - the engine's controller ends it with ``end_update`` - and
    judged again, before the next update begins: a loader may refuse a ``begin_update`` while
    an update is open.
``lifecycle`` (claimed ``sessions``)
    Misuse of the session (:data:`PROBES`) is refused with an error or handled as documented,
    and never corrupts: the parameters and the version say what happened, and the next full
    update lands. A second ``begin_update`` is judged at once, before the restarted (or
    continued) update completes: a refused one wrote nothing, an accepted one (a restart)
    moved no version and - where the engine still names its last version - left the
    parameters holding it (no silent mix of what the open update carried).
"""

from __future__ import annotations

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import fused_name
from pytest_weightsync.reference_impl.oracle import synth

from . import inputs, judge
from .judge import ConformanceError
from .lifecycle_engine import (
    EngineRank,
    attempt,
    bad_bucket,
    changed,
    end_marked,
    failure_point,
    kind,
    named,
    recover,
    refused,
    start,
)

#: How an update fails mid-stream.
FAILURES = ("refused_bucket", "sender_exception", "lost_rank")
#: Misuse of the session the ``lifecycle`` property probes.
PROBES = ("outside_session", "double_begin", "end_without_begin", "begin_after_failure")


def check_atomic(impl, case, fmt: str, failure: str) -> None:
    """Version 2 fails at :func:`failure_point` by ``failure``; judged as the module says;
    then version 3 in full."""
    if failure not in FAILURES:
        raise ValueError(f"unknown failure {failure!r}; expected one of {FAILURES}")
    engine = start(impl, case, fmt)
    old = engine.before_step = compare.snapshot(engine.params)
    stream = engine.stream(2, bucket="tensor")
    cut = failure_point(stream, case, engine.rank)
    at = f"bucket {cut} of {len(stream)}"
    engine.begin()
    for piece in stream[:cut]:
        engine.load(piece)
    end_error = None
    if failure == "refused_bucket":
        bad, what = bad_bucket(stream[cut], case, engine.rank)
        if attempt(engine.load, bad) is None:  # accepted: the sender goes on
            for piece in stream[cut + 1:]:
                engine.load(piece)
            end_error = end_marked(engine, lambda: (
                f"silent mix: {impl.name} accepted a bad bucket at {at} ({what}) and "
                f"completed the update on {engine.where}: {engine.mix_summary()} - a loader "
                f"that claims 'atomic' refuses a bucket it cannot load, and the update fails"))
        else:
            end_error = attempt(engine.end)  # the sender's `finally`
    elif failure == "sender_exception":  # the sender raised before bucket `cut`; its
        end_error = attempt(engine.end)    # `finally` ends the session
    else:  # lost rank: the buckets stop and nothing ends the session - judged while it is open
        engine.not_moved(f"an update whose sender was lost at {at}, its session still open",
                         bits_unchanged=not changed(old, engine.params))
        # ... then abandoned the documented way: the engine's controller ends it
        end_error = attempt(engine.end)
    how = ("abandoned after its sender was lost, ended by the engine's controller"
           if failure == "lost_rank" else failure)
    bits_old = not changed(old, engine.params)
    engine.not_moved(f"an update that failed at {at} ({how})", bits_unchanged=bits_old)
    marked = end_error is not None or engine.says_no_version()
    if not bits_old and not marked:
        raise ConformanceError(
            f"silent mix: end_update completed an update that failed at {at} ({how}) on "
            f"{engine.where}, and nothing marks the engine unusable: {engine.mix_summary()} "
            f"(an atomic engine keeps the old bits, refuses the end_update, or says None in "
            f"weight_version until a full update; NeMo-RL#2444, tokenspeed#672)")
    recover(engine, 3, f"an update that failed at {at} ({failure})")


def check_probe(impl, case, fmt: str, probe: str) -> None:
    """Misuse ``probe`` of a session on an engine holding version 1 (see the module)."""
    if probe not in PROBES:
        raise ValueError(f"unknown probe {probe!r}; expected one of {PROBES}")
    engine = start(impl, case, fmt)
    held = engine.before_step = compare.snapshot(engine.params)
    if probe == "end_without_begin":
        error = attempt(engine.end)
        _unchanged(engine, held, "an end_update without begin_update", error)
        engine.not_moved("an end_update without begin_update", bits_unchanged=True)
        recover(engine, 3, "an end_update without begin_update")
    elif probe == "outside_session":
        _outside_session(engine, held)
        recover(engine, 3, "a bucket loaded outside a session")
    elif probe == "double_begin":
        _double_begin(engine, held)
    else:
        _begin_after_failure(engine)


def _double_begin(engine: EngineRank, held) -> None:
    """Half of version 2, a second ``begin_update``, judged at once; then the update completes
    (restarted, or continued after a refusal) and lands."""
    stream = engine.stream(2)
    half = max(1, len(stream) // 2)
    engine.begin()
    for piece in stream[:half]:
        engine.load(piece)
    open_bits = compare.snapshot(engine.params)
    error = attempt(engine.begin)
    if error is not None:  # refused: it writes nothing, and the open update goes on
        how = f"refused ({judge.quoted(error, 200)}; the open update went on)"
        _unchanged(engine, open_bits, "a refused second begin_update", error, held_version=None)
        engine.not_moved("a refused second begin_update", open_update=True,
                         bits_unchanged=not changed(held, engine.params))
    else:  # a restart: no version moved, and no version named over what the open update wrote
        how = "accepted (the update restarted)"
        engine.not_moved(
            "a second begin_update, accepted as a restart", open_update=True,
            bits_unchanged=not changed(open_bits, engine.params),
            stale="silent mix at a second begin_update (accepted as a restart)")

    def rest():
        for piece in (stream if error is None else stream[half:]):  # restarted, or goes on
            engine.load(piece)
        engine.end()
    refused(f"a second begin_update was neither refused nor a restart: after it was {how}, "
            f"the update could not complete on {engine.where}", rest)
    try:
        engine.check(2, before=engine.poisoned, previous_version=1)
    except ConformanceError as failure:
        raise named(failure, engine, 2, f"after a second begin_update, {how}, the update "
                                        f"did not land on {engine.where}") from None
    engine.completed(f"an update with a second begin_update {how.split(' (')[0]}")


def _begin_after_failure(engine: EngineRank) -> None:
    """Version 2 fails at a refused bucket; a ``begin_update`` (after an ``end_update`` of the
    failed session where the first is refused) opens version 3, which lands."""
    impl, case = engine.impl, engine.case
    stream = engine.stream(2, bucket="tensor")
    cut = failure_point(stream, case, engine.rank)
    engine.begin()
    for piece in stream[:cut]:
        engine.load(piece)
    attempt(engine.load, bad_bucket(stream[cut], case, engine.rank)[0])
    if attempt(engine.begin) is not None:  # refused: end the failed session, then begin
        attempt(engine.end)
        error = attempt(engine.begin)
        if error is not None:
            raise ConformanceError(
                f"stuck after a failed update: {impl.name} refused begin_update after the "
                f"update failed at bucket {cut} and again after end_update on "
                f"{engine.where}: {judge.quoted(error, 400)}")

    def rest():
        for piece in engine.stream(3):
            engine.load(piece)
        engine.end()
    refused(f"stuck after a failed update: the update begun after it (at bucket {cut}) "
            f"could not complete on {engine.where}", rest)
    try:
        engine.check(3, previous_version=1)
    except ConformanceError as failure:
        raise named(failure, engine, 3, f"the update begun after a failed one did not "
                                        f"land on {engine.where}") from None
    engine.completed("the update begun after a failed one")


def _unchanged(engine, held, what: str, error, held_version=1) -> None:
    """Misuse ``what`` (refused with ``error``, or accepted) changed no bit of ``held``. The
    located difference is judged against version ``held_version`` where the parameters held
    one (``None``: mid-update, nothing to locate against)."""
    moved = changed(held, engine.params)
    if not moved:
        return
    located, mismatch = "", None
    if held_version is not None:
        try:
            engine.check(held_version, before=held)
        except ConformanceError as failure:
            located, mismatch = str(failure), failure.mismatch
    said = f"raised {judge.quoted(error, 200)} but " if error is not None else ""
    raise ConformanceError(f"misuse corrupted the weights: {what} {said}changed {len(moved)} "
                           f"parameter(s) of {engine.where}: {[kind(n) for n in moved[:4]]} - "
                           f"misuse of the session must be refused or handled, never corrupt "
                           f"the weights\n{located}", mismatch)


def _outside_session(engine: EngineRank, held) -> None:
    """Layer 0 of version 2 in one bucket, with no ``begin_update``: refused (nothing
    written) or written as documented - layer 0 holds version 2 (in the engine's layout, or in
    the checkpoint layout awaiting post-load processing), nothing else changed but a
    post-load engine's layout restore - and it completes no update: no complete version
    claimed once it changed the parameters."""
    case, rank = engine.case, engine.rank
    bucket = [pair for piece in engine.stream(2, bucket="whole", layers=[0]) for pair in piece]
    error = attempt(engine.load, bucket)
    what = "a bucket loaded outside a session"
    if error is not None:
        _unchanged(engine, held, f"a refused {what}", error)
        engine.not_moved(f"a refused {what}", bits_unchanged=True)
        return
    layer0 = {fused_name(0, "w13"), fused_name(0, "w2")}
    if case.receiver.default_engine:
        try:
            engine.check(2, before=held, touched=sorted(layer0), previous_version=1)
        except ConformanceError as failure:
            raise ConformanceError(f"{what} was accepted but did not land as written on "
                                   f"{engine.where} (layer 0 at version 2, the rest "
                                   f"untouched):\n{failure}", failure.mismatch) from None
    else:
        post_load = case.receiver.engine_layout in engine_layout.POST_LOAD
        for version, names in ((2, layer0), (1, set(held.records) - layer0)):
            done = inputs.expected(case, rank, version)
            raw = synth.expected_receiver_params(case.spec, case.receiver, rank, version)
            for name in sorted(names):
                got = engine.params[name]
                fits = [compare.same_bits(got, done[name])] if name in done else []
                if post_load and name in raw:
                    fits.append(compare.same_bits(got, raw[name]))
                if version == 1:
                    fits.append(compare.same_bits(got, held.records[name].copy))
                if not any(fits):
                    raise ConformanceError(
                        f"{what} was accepted and left {name} of {engine.where} in no state of "
                        f"version {version} (neither the engine's layout"
                        f"{' nor the checkpoint layout awaiting post-load' if post_load else ''}"
                        f"{' nor its bits before' if version == 1 else ''})")
    if not changed(held, engine.params):  # accepted and ignored
        engine.not_moved(f"an ignored {what}", bits_unchanged=True)
    elif engine.versioned and engine.version() is not None:
        raise ConformanceError(
            f"{what} changed layer 0 of {engine.where}, yet weight_version says "
            f"{engine.version()!r}: the parameters mix versions 1 and 2 "
            f"({engine.mix_summary()}) - a bucket outside a session completes no update, so no "
            f"complete version until a full update (answer None)")
