"""Judging a receiver rank after an update: the one conformance check every suite applies.

The expected state comes from the synthetic value function at layout coordinates
(:func:`suites.harness.inputs.expected`) - never from the implementation's own output. Every
parameter must keep its address; the parameters the update owed must equal the expected state
in every bit; every other parameter (the router weight included) must be bit-identical to
what it held before. A mismatch is reported with its first differing (layer, expert,
projection, row, col) and, when the pattern is a known bug, a first line naming it
(:mod:`.diagnosis`: gate/up halves swapped, stale values, elements never written, padding not
zeroed).

One rank's judgement goes one way down: this module decides what to check, :mod:`.inputs`
what is expected, :mod:`pytest_weightsync.compare` how a tensor differs, :mod:`.diagnosis`
which bug the difference looks like.
"""

from __future__ import annotations

from pytest_weightsync import compare

from . import diagnosis, inputs

#: Kinds of bit difference (``compare.DifferenceKinds``) that no placement bug produces, and
#: what does produce them.
VALUE_CONVERSIONS = {
    "nan_payload": "e.g. it stages BF16 through FP32 or another dtype, which canonicalizes NaNs",
    "zero_sign": "e.g. an arithmetic op such as x + 0 or a sum that loses the sign of zero",
    "subnormal_flush": "e.g. a kernel or dtype round trip that flushes subnormals to zero",
}
#: Longest implementation message quoted inside a conformance failure (a loader that raises
#: with megabytes of text must not flood the terminal, the junit file or the JSON report).
MAX_QUOTED = 2000


class ConformanceError(AssertionError):
    """An implementation's result differs from the reference; the message says where and,
    when recognizable, which bug it looks like. ``mismatch`` is the located
    :class:`pytest_weightsync.compare.BitMismatchError` behind it, when there is one."""

    def __init__(self, message: str, mismatch=None):
        super().__init__(message)
        self.mismatch = mismatch

    @property
    def location(self):
        return getattr(self.mismatch, "location", None)


def quoted(error: BaseException, limit: int = MAX_QUOTED) -> str:
    """``Type: message`` of an implementation's exception, cut to ``limit`` characters."""
    text = f"{type(error).__name__}: {error}"
    if len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} more characters]"
    return text


def check_rank(params, case, rank, version, before=None, touched=None, previous_version=None,
               *, cached=True, side="loader", device=None):
    """Receiver ``rank`` after loading ``version`` into the parameters in ``touched`` (default
    every parameter the update owes): every parameter at its old address, the touched ones
    bit-identical to the expected state, every other one (the router weight included)
    bit-identical to ``before`` (a :func:`pytest_weightsync.compare.snapshot` taken before the
    update; without one only the values are judged). ``cached=False`` computes the expected
    state afresh: self-tests that plant a bug in the value function or the layout model need
    it computed under the plant. ``side`` is the side of the sync under test
    (:data:`.diagnosis.SIDES`): ``loader`` where ``params`` were written by the loader under
    test from the harness's own payload, ``exporter`` where a reference receiver loaded the
    payload of the exporter under test; a named pattern blames only that side. ``device``:
    where the expected state is built and compared (default the CPU; a GPU run passes the
    parameters' device, so a real-size layer is never hashed on the host); a mismatch is
    diagnosed on the CPU either way."""
    if before is not None:
        compare.assert_same_storage(before, params, rank=rank)
    cache = inputs.expected if cached else inputs.expected_uncached
    expected_of = cache if device is None else (lambda c, r, v: cache(c, r, v, device))
    expected = expected_of(case, rank, version)
    touched = list(expected) if touched is None else list(touched)
    locate = inputs.locator(case, rank)
    missing = [name for name in touched if name not in params]
    if missing:
        raise ConformanceError(f"receiver rank {rank}: parameters {missing[:4]} are missing from "
                               f"the parameter set ({len(missing)} in all)")
    for name in touched:
        try:
            compare.assert_bitwise_equal(params[name], expected[name], name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            previous = (expected_of(case, rank, previous_version)[name]
                        if previous_version is not None else None)
            old = before.records[name].copy if before is not None else None
            if device is not None:  # the diagnosis builds its own candidates on the CPU
                params, expected = {name: params[name].cpu()}, {name: expected[name].cpu()}
                previous, old = (None if t is None else t.cpu() for t in (previous, old))
            kind = getattr(getattr(error, "kinds", None), "kind", "value")
            if not case.receiver.default_engine:  # engine bugs first; bit kinds are BF16's
                hint = diagnosis.diagnose(name, params[name], expected[name], case, rank, old,
                                          previous, version, side=side)
            elif kind in VALUE_CONVERSIONS:
                who = {"loader": "the loader", "exporter": "the exporter"}.get(side, "the sync")
                hint = (f"not a placement bug: {error.kinds.describe()} - {who} converts "
                        f"values on the way ({VALUE_CONVERSIONS[kind]})")
            else:
                hint = diagnosis.diagnose(name, params[name], expected[name], case, rank, old,
                                          previous, version, side=side)
            raise ConformanceError((f"{hint}\n" if hint else "") + str(error), error) from None
    for name, record in (before.records.items() if before is not None else ()):
        if name in touched:
            continue
        try:
            compare.assert_bitwise_equal(params[name], record.copy, name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            raise ConformanceError(f"wrote outside the payload: {name} was not in it and "
                                   f"changed\n{error}", error) from None
