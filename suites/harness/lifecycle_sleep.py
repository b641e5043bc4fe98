"""``lifecycle``, sleep and wake between updates (claimed ``sleep``).

The engine gives its weights' memory back between updates (:data:`SLEEP_LEVELS`, vLLM's
``sleep(level)`` / ``wake_up``). After a level-1 ``sleep`` and ``wake_up`` every parameter
holds its bits at its address, the version unmoved, and the next update lands. Level 2
discards what the updates carry - on the suites' experts-only engines the routed experts'
``w13_weight`` / ``w2_weight`` - and nothing else: a parameter no update carries (the router
weight) would never be restored, so it must hold its bits. After it no complete version is
claimed, an update that stops short is refused or leaves the engine marked unusable, and the
next complete update lands.
"""

from __future__ import annotations

from pytest_weightsync import compare

from . import calls, inputs
from .judge import ConformanceError
from .lifecycle_engine import (
    changed,
    end_marked,
    failure_point,
    kind,
    recover,
    refused,
    start,
)

#: Sleep levels (vLLM's: 1 offloads the weights to host memory, 2 discards them).
SLEEP_LEVELS = (1, 2)


def check_sleep(impl, case, fmt: str, level: int) -> None:
    """An engine holding version 1 sleeps at ``level`` and wakes; judged as the module says."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"unknown sleep level {level!r}; expected one of {SLEEP_LEVELS}")
    engine = start(impl, case, fmt)
    held = engine.before_step = compare.snapshot(engine.params)
    kwargs = dict(spec=case.spec, topology=case.receiver, rank=engine.rank)
    refused(f"sleep(level={level}) was refused on {engine.where}",
            lambda: calls.call(impl, "sleep", engine.params, level=level, **kwargs))
    refused(f"wake_up after sleep(level={level}) was refused on {engine.where}",
            lambda: calls.call(impl, "wake_up", engine.params, **kwargs))
    compare.assert_same_storage(held, engine.params, rank=engine.rank)
    what = f"a level-{level} sleep and wake_up"
    if level == 1:
        moved = changed(held, engine.params)
        if moved:
            try:
                engine.check(1, before=held)
                located, mismatch = "", None
            except ConformanceError as failure:
                located, mismatch = str(failure), failure.mismatch
            raise ConformanceError(
                f"weights lost across a level-1 sleep: after {what}, {len(moved)} of "
                f"{len(held.records)} parameter(s) of {engine.where} no longer hold their bits: "
                f"{[kind(n) for n in moved[:4]]} - level 1 offloads the weights and wake_up "
                f"restores every bit at its address (vLLM's sleep level 1)\n{located}", mismatch)
        engine.not_moved(what, bits_unchanged=True)
        recover(engine, 2, what)
        return
    carried = set(inputs.expected(case, engine.rank, 1))
    kept = [n for n in changed(held, engine.params) if n not in carried]
    if kept:
        raise ConformanceError(
            f"level-2 sleep discarded what no update carries: after {what}, {kept[:4]} of "
            f"{engine.where} no longer hold their bits - level 2 may discard only the "
            f"parameters an update brings back (on an experts-only engine the routed experts' "
            f"w13_weight / w2_weight); the rest must survive it (vLLM keeps buffers and "
            f"sleep_preserve_parameter_names), or no update ever restores them")
    if engine.versioned and engine.version() is not None:
        raise ConformanceError(
            f"version survives a level-2 sleep: weight_version says {engine.version()!r} after "
            f"{what} on {engine.where}, but level 2 discards the weights: no complete version "
            f"is held until a complete update (answer None)")
    stream = engine.stream(2, bucket="tensor")
    cut = failure_point(stream, case, engine.rank)
    engine.begin()
    for piece in stream[:cut]:
        engine.load(piece)
    end_marked(engine, lambda: (
        f"partial update accepted after a level-2 sleep: end_update completed an update of "
        f"{cut} of {len(stream)} buckets on {engine.where} after {what}, and nothing marks "
        f"the engine unusable - what no bucket carried holds whatever the discarded memory "
        f"held (after level 2 the next update must be complete)"))
    recover(engine, 3, f"{what} and an update that stopped short")
