"""``version`` (claimed ``version``): ``weight_version`` moves exactly once per completed update
- an identity update too - and nowhere else; it names a complete version only while the
parameters hold it.

The identity update here is FINITE (the oracle's finite weights sent twice): with the full bit
patterns (NaNs) a loader that moves its version only when some value changed would see NaN !=
NaN as a change and pass; with finite weights nothing changed but the update completed, so
the version must still move.
"""

from __future__ import annotations

from pytest_weightsync import compare

from .lifecycle_engine import (
    attempt,
    changed,
    failure_point,
    identity_expected,
    identity_stream,
    identity_update,
    start,
)


def check_version(impl, case, fmt: str) -> None:
    """On the last rank: version 1 (the full bit patterns); then the finite weights, the
    version read after ``begin_update``, after every bucket and after ``end_update``; the same
    finite weights again (an identity update: no bit changes, a completed update all the
    same); version 3 abandoned mid-stream by the sender (``end_update`` in its ``finally``);
    version 4 in full. Each completed update moves the version exactly once, nothing else
    moves it, and mid-update it is None or the last complete version, never a new one."""
    engine = start(impl, case, fmt)
    held = engine.before_step = compare.snapshot(engine.params)
    stream = identity_stream(engine, "tensor")

    finite = identity_expected(case, engine.rank)

    def unchanged() -> bool:
        return not changed(held, engine.params)
    engine.begin()
    engine.not_moved("begin_update", bits_unchanged=unchanged(), open_update=True, new=finite)
    for index, piece in enumerate(stream):
        engine.load(piece)
        engine.not_moved(f"bucket {index} of {len(stream)} (before end_update)",
                         bits_unchanged=unchanged(), open_update=True, new=finite)
    engine.end()
    engine.completed("the update to the finite weights")
    identity_update(engine, "multi_layer")
    engine.completed("an identity update (the same finite weights sent again: no bit changed, "
                     "the update completed)")
    engine.before_step = compare.snapshot(engine.params)
    stream = engine.stream(3, bucket="tensor")
    cut = failure_point(stream, case, engine.rank)
    engine.begin()
    for piece in stream[:cut]:
        engine.load(piece)
    attempt(engine.end)  # the sender failed before bucket `cut` and ends in its `finally`
    engine.not_moved(f"an update abandoned at bucket {cut} of {len(stream)}",
                     bits_unchanged=not changed(engine.before_step, engine.params), new=3)
    engine.update(4)
    engine.check(4)
    engine.completed("the full update after the abandoned one")
