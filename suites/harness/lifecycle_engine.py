"""One engine rank driven through the update lifecycle, and what every lifecycle property needs.

:class:`EngineRank` holds one engine rank's parameters (poisoned, as an engine allocates them)
and calls the loader under test the way an engine's update path calls it - always with the
same ``params`` dict and the same tensor objects, from its first update to its last. The
version rules every property shares live here (:meth:`EngineRank.completed`,
:meth:`EngineRank.not_moved`), so the contract they judge is stated once: ``weight_version``
moves exactly once per completed update, and it names a complete version only while the
parameters hold that version bit for bit - otherwise ``None``
(``docs/validate-your-loader.md``, "The update lifecycle", point 5).

The property modules (``lifecycle_identity``, ``lifecycle_failure``, ``lifecycle_sleep``,
``lifecycle_version``, ``lifecycle_coverage``) build on this one; callers import them through
:mod:`.lifecycle`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Optional

from pytest_weightsync import compare
from pytest_weightsync.deadline import CallTimeoutError
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import parse_receiver_name, receiver_shard
from pytest_weightsync.reference_impl.oracle import synth

from . import calls, claims, inputs, judge
from .judge import ConformanceError
from .loader import frames_updates
from .memo import memo


def attempt(call, *args, **kwargs) -> Optional[Exception]:
    """Run ``call``; the exception it raised (a refusal), or ``None``. A call past the time
    limit is no refusal: it fails the test."""
    try:
        call(*args, **kwargs)
    except CallTimeoutError:
        raise
    except Exception as error:  # any error is a refusal the caller can see
        return error
    return None


def end_marked(engine, silent) -> Optional[Exception]:
    """End the update session (the sender's ``finally``); the refusal, or ``None``. An
    end_update that completes while ``weight_version`` does not say None is a silent mix: a
    :class:`ConformanceError` with the message ``silent()`` - built only then, since describing
    the mix reads the engine. The one judgement the failed-update and the level-2-sleep
    properties share."""
    error = attempt(engine.end)
    if error is None and not engine.says_no_version():
        raise ConformanceError(silent())
    return error


def engine_side(impl) -> bool:
    """Whether ``impl`` frames updates itself (defines ``begin_update`` and ``end_update``)."""
    return frames_updates(impl)


def require(impl, case, fmt, claim: Optional[str] = None) -> None:
    """Skip unless ``impl`` claims ``case`` and ``fmt`` as a loader and, for ``claim``, that part
    of the lifecycle (not claimed), and - for a claim - frames its updates (else there is
    nothing to judge: not applicable)."""
    claims.require_claim(impl, "loader", case, fmt)
    if claim is None:
        return
    reason = impl.capabilities.lifecycle_refusal(claim)
    if reason is not None:
        claims.skip_unclaimed(f"{impl.name} {reason}")
    if not engine_side(impl):  # claiming sessions / atomic without them is a usage error
        claims.skip_not_applicable(f"{impl.name} defines no begin_update/end_update: it has "
                                   f"no update session for {claim!r} to judge")


def kind(name: str) -> str:
    """``name`` with what it is (a fused gate/up parameter, or down)."""
    parsed = parse_receiver_name(name)
    if parsed is None:
        return name
    if parsed.projection == "w13":
        return f"{name} (a fused parameter: gate and up)"
    return f"{name} (down)"


def changed(before: compare.Snapshot, params) -> list[str]:
    """Names of the parameters whose bits differ from ``before``."""
    return [name for name, record in before.records.items()
            if not compare.same_bits(params[name], record.copy)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EngineRank:
    """One engine rank's parameters (poisoned, as an engine allocates them) and the loader
    under test, called the way the engine's update path calls it: every call gets the same
    ``params`` dict holding the same tensor objects."""

    def __init__(self, impl, case, rank: int, fmt: str):
        self.impl, self.case, self.rank, self.fmt = impl, case, rank, fmt
        self.params = inputs.receiver_params(case, rank)
        self.poisoned = compare.snapshot(self.params)
        self.versioned = impl.capabilities.lifecycle_refusal("version") is None
        self.last_version = None  # the last complete version weight_version said
        self.versions_seen: list = []
        #: The parameters before the step being judged (a snapshot), for :meth:`mix_summary`.
        self.before_step: Optional[compare.Snapshot] = None

    @property
    def where(self) -> str:
        return f"engine rank {self.rank} of {self.case.id} ({self.fmt})"

    def _kwargs(self) -> dict:
        return dict(format=self.fmt, spec=self.case.spec, topology=self.case.receiver,
                    rank=self.rank)

    # -- the calls ------------------------------------------------------------------------

    def begin(self) -> None:
        calls.call_optional(self.impl, "begin_update", self.params, **self._kwargs())

    def load(self, bucket) -> None:
        calls.call(self.impl, "load_weights", self.params, list(bucket), **self._kwargs())

    def end(self) -> None:
        calls.call_optional(self.impl, "end_update", self.params, **self._kwargs())

    def stream(self, version: int, bucket="split_layer", layers=None) -> list:
        return inputs.stream(self.fmt, self.case, self.rank, version, layers, bucket=bucket)

    def update(self, version: int, bucket="split_layer") -> None:
        """One full update to ``version``, framed by the loader's hooks."""
        self.begin()
        for piece in self.stream(version, bucket):
            self.load(piece)
        self.end()

    def check(self, version: int, before=None, touched=None, previous_version=None) -> None:
        """The oracle's judgement (:func:`suites.harness.judge.check_rank`)."""
        judge.check_rank(self.params, self.case, self.rank, version,
                         self.poisoned if before is None else before, touched=touched,
                         previous_version=previous_version)

    # -- the version ----------------------------------------------------------------------

    def version(self):
        """``weight_version`` of the parameters (only called when claimed)."""
        return calls.call(self.impl, "weight_version", self.params, spec=self.case.spec,
                          topology=self.case.receiver, rank=self.rank)

    def says_no_version(self) -> bool:
        """Whether the engine marks itself unusable: ``weight_version`` claimed and ``None``
        (no complete version held)."""
        return self.versioned and self.version() is None

    def completed(self, what: str) -> None:
        """After a completed update: the version moved exactly once (an ``int`` by one), to a
        value never held before. Nothing to judge when ``version`` is not claimed."""
        if not self.versioned:
            return
        now = self.version()
        last = self.last_version
        if now is None:
            raise ConformanceError(f"{self.impl.name}: weight_version is None after {what} "
                                   f"completed on {self.where} (a completed update is a "
                                   f"complete version)")
        if last is not None:
            if now == last:
                raise ConformanceError(f"version did not move: weight_version is still {last!r} "
                                       f"after {what} completed on {self.where}")
            if now in self.versions_seen:
                raise ConformanceError(f"version moved back: weight_version is {now!r} after "
                                       f"{what} on {self.where}, a version it held before "
                                       f"(then {self.versions_seen})")
            if _is_int(now) and _is_int(last) and now != last + 1:
                raise ConformanceError(f"version moved by {now - last}, not once: weight_version "
                                       f"went {last} -> {now} over {what} on {self.where} (one "
                                       f"completed update moves it exactly once)")
        self.last_version = now
        self.versions_seen.append(now)

    def not_moved(self, what: str, *, bits_unchanged: bool, new=2,
                  open_update: bool = False, stale: Optional[str] = None) -> object:
        """Where no update completed (mid-update, after a failure, a refused call, a second
        ``begin_update``): the version is ``None`` or the last complete one, never a new one.
        Once no update is open, the last complete one only while the parameters still hold it
        bit for bit (``bits_unchanged``). ``open_update``: an update is open - its buckets may
        be written in place while the engine still names the version it last completed (as
        SGLang's ``weight_version`` label does until the update is published), unless
        ``stale`` heads the failure: then ``bits_unchanged`` says whether the step being
        judged itself left the bits alone (a second ``begin_update`` that flushes what was
        staged). ``new`` is what the step was writing (:meth:`mix_summary`). Returns what the
        version said."""
        if not self.versioned:
            return None
        now = self.version()
        if now is None:
            return now
        if now != self.last_version:
            raise ConformanceError(
                f"version published without a completed update: weight_version moved "
                f"{self.last_version!r} -> {now!r} at {what} on {self.where} (it may move only "
                f"when an update completes, never at begin_update, a bucket or a failed "
                f"update; tokenspeed#672: a version published after a failed chunk)")
        if open_update and stale is None:
            return now  # mid-refit: the label of the last completed update
        if not bits_unchanged:
            if stale is None:
                stale = "partial advance"
            why = ("the step itself wrote the update's buckets while the engine still names a "
                   "complete version; a restart writes nothing of what the abandoned update "
                   "staged" if open_update else "NeMo-RL#2444: a failed sync left the weights "
                   "partly advanced; answer None until a full update")
            raise ConformanceError(
                f"{stale}: weight_version still says {now!r} (a complete version) at {what} "
                f"on {self.where}, while the parameters no longer hold it: "
                f"{self.mix_summary(new)} ({why})")
        return now

    def mix_summary(self, new=2) -> str:
        """How the parameters mix what they held before the step (:attr:`before_step`) and
        version ``new`` (or ``new`` itself: the expected parameters of the update's weights)."""
        old = self.before_step
        if isinstance(new, dict):
            expected, new = new, "the update's weights"
        else:
            expected, new = inputs.expected(self.case, self.rank, new), f"version {new}"
        parts = []
        for name in changed(old, self.params):
            if name not in expected:
                parts.append(f"{name} changed (not part of any update)")
                continue
            got = compare.raw_bits(self.params[name])
            was = compare.raw_bits(old.records[name].copy)
            want = compare.raw_bits(expected[name])
            differ = was != want
            moved = int(((got == want) & differ).sum())
            stayed = int(((got == was) & differ).sum())
            parts.append(f"{name}: {moved} element(s) hold {new}, {stayed} still the "
                         f"previous one")
        if not parts:
            return "no parameter changed"
        return "; ".join(parts[:4]) + (f"; ... ({len(parts)} parameters)" if len(parts) > 4
                                       else "")


# --------------------------------------------------------------------------------------------
# The finite weights (identity syncs, the version's identity update)
# --------------------------------------------------------------------------------------------

#: The version the identity syncs send. Their weights are the oracle's FINITE values (normal
#: BF16 numbers of moderate exponent, ``synth.full_weights(finite=True)``): a forward over the
#: full bit patterns (infinities, NaNs) is NaN everywhere and would not see a changed weight,
#: and a loader that compares values (NaN != NaN) would see a change where no bit changed.
IDENTITY_VERSION = 1


@memo(8)
def identity_weights(spec):
    """The full finite weights every identity update sends (read only)."""
    return synth.full_weights(spec, IDENTITY_VERSION, finite=True)


@memo(32)
def identity_expected(case, rank: int) -> dict:
    """What ``rank`` holds after an update of :func:`identity_weights`, in the engine's layout
    (the oracle at layout coordinates; read only)."""
    spec, topo = case.spec, case.receiver
    if topo.default_engine:
        return synth.expected_receiver_params(spec, topo, rank, IDENTITY_VERSION, finite=True)
    return synth.expected_engine_params(spec, topo, rank, IDENTITY_VERSION, finite=True)


def identity_stream(engine: EngineRank, bucket) -> list:
    """The update of :func:`identity_weights` for ``engine``, cut at ``bucket``."""
    return inputs.stream(engine.fmt, engine.case, engine.rank,
                         full=identity_weights(engine.case.spec), bucket=bucket)


def identity_update(engine: EngineRank, bucket) -> None:
    """One full framed update of :func:`identity_weights`."""
    engine.begin()
    for piece in identity_stream(engine, bucket):
        engine.load(piece)
    engine.end()


@contextlib.contextmanager
def load_warnings():
    """Every warning raised and every log record at WARNING or above while the block runs
    (SkyRL's check: no "Failed to load weights" during a sync), as short strings."""
    caught: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            caught.append(f"log {record.name} {record.levelname}: {record.getMessage()[:200]}")

    handler = _Handler(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            yield caught
        caught.extend(f"warning {w.category.__name__}: {str(w.message)[:200]}" for w in raised)
    finally:
        root.removeHandler(handler)


def post_load_timing(engine: EngineRank, version: int, finite: bool = False) -> Optional[str]:
    """The name of a post-load engine whose expert tiles are partly raw and partly processed:
    post-load processing ran before some writes landed (prime-rl#2389), or over part of the
    update only. ``finite``: ``version`` of the finite weights (the identity syncs')."""
    case = engine.case
    if case.receiver.engine_layout not in engine_layout.POST_LOAD:
        return None
    raw = synth.expected_receiver_params(case.spec, case.receiver, engine.rank, version,
                                         finite=finite)
    done = (identity_expected(case, engine.rank) if finite
            else inputs.expected(case, engine.rank, version))
    n_raw = n_done = total = 0
    first = None
    for name, want in done.items():
        for slot in range(want.shape[0]):
            total += 1
            if compare.same_bits(engine.params[name][slot], raw[name][slot]):
                n_raw += 1
                first = first or f"{name} slot {slot}"
            elif compare.same_bits(engine.params[name][slot], want[slot]):
                n_done += 1
    if n_raw and n_done:
        return (f"post-load processing ran before the writes landed: {n_raw} of {total} expert "
                f"tiles hold the rows as written (the raw checkpoint layout, e.g. {first}) while "
                f"{n_done} hold the {case.receiver.engine_layout} layout - end_update processed "
                f"the weights before the last writes completed, and those landed raw "
                f"(prime-rl#2389)")
    if n_raw == total:
        return (f"post-load processing ran before the writes landed, or not at all: every one "
                f"of the {total} expert tiles holds the rows as written (the raw checkpoint "
                f"layout) after end_update, none the {case.receiver.engine_layout} layout "
                f"(prime-rl#2389)")
    return None


def named(error: ConformanceError, engine: EngineRank, version: int,
          what: str) -> ConformanceError:
    """``error`` (a failed judgement of ``version``) headed by the lifecycle pattern it shows
    when one is recognized, else by ``what`` happened."""
    timing = post_load_timing(engine, version)
    head = f"{timing} - {what}" if timing else what
    return ConformanceError(f"{head}\n{error}", error.mismatch)


# --------------------------------------------------------------------------------------------
# Updates that stop short, and the engine the failure properties start from
# --------------------------------------------------------------------------------------------


def _owned(bucket, case, rank) -> Optional[int]:
    """Index of the first entry of ``bucket`` that ``rank`` loads, or ``None``."""
    experts = receiver_shard(case.spec, case.receiver, rank).experts
    for index, (name, _) in enumerate(bucket):
        parsed = parse_receiver_name(name)
        if parsed is None or parsed.expert is None or parsed.expert in experts:
            return index
    return None


def failure_point(stream, case, rank) -> int:
    """The bucket an update fails at: past the middle, with a bucket the rank loads before it
    (so the failed update has written something) and one at it (so a refusal is the rank's)."""
    owned = [i for i, bucket in enumerate(stream) if _owned(bucket, case, rank) is not None]
    later = [i for i in owned if i >= len(stream) // 2 and i > owned[0]]
    if not later:
        raise AssertionError(f"a stream of {len(stream)} bucket(s) cannot fail mid-stream on "
                             f"engine rank {rank} of {case.id} (a harness bug)")
    return later[0]


def bad_bucket(bucket, case, rank) -> tuple[list, str]:
    """``bucket`` with the first entry the rank loads cut short by one column: a shape every
    loader must refuse (``pytest_weightsync.protocols``)."""
    bucket = list(bucket)
    index = _owned(bucket, case, rank)
    name, tensor = bucket[index]
    bucket[index] = (name, tensor[..., :-1].contiguous())
    return bucket, f"entry {index} {name!r} cut to {tuple(bucket[index][1].shape)}"


def start(impl, case, fmt) -> EngineRank:
    """The last rank of ``case`` holding a complete version 1 (judged), its version read."""
    engine = EngineRank(impl, case, case.receiver.world_size - 1, fmt)
    engine.update(1)
    engine.check(1)
    engine.completed("the first update")
    return engine


def refused(what: str, run) -> None:
    """Run ``run`` (the calls of an update the engine must take); an error from it is a
    conformance failure headed by ``what``."""
    error = attempt(run)
    if error is not None:
        raise ConformanceError(f"{what}: {judge.quoted(error, 600)}")


def recover(engine: EngineRank, version: int, after: str) -> None:
    """The next full update lands bit-exact and moves the version once."""
    refused(f"stuck after {after}: the next full update was refused on {engine.where}",
            lambda: engine.update(version))
    try:
        engine.check(version, previous_version=1)
    except ConformanceError as error:
        raise named(error, engine, version,
                    f"the full update after {after} did not land on {engine.where}") from None
    engine.completed(f"the full update after {after}")
