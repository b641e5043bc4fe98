"""The update lifecycle of an engine-side loader, driven and judged (``test_lifecycle``).

A loader with ``begin_update`` / ``end_update`` is the engine end of a session: updates open,
stream, close - and fail, get abandoned, are repeated with the same weights, reach every rank
and replica, and move the engine's version. The public bugs of 2026 around the update (not
inside one bucket, ``../shared/DOMAIN.md`` section 10) are each one property here:

``identity``
    The engine's own weights sent back :data:`IDENTITY_SYNCS` times, each stream cut at
    another bucket limit: every parameter bit-identical after every sync, the engine's
    post-load processing included, and the reference MoE forward
    (:mod:`~pytest_weightsync.reference_impl.oracle.moe_forward`) on a fixed input unchanged
    and equal to the forward over the oracle's weights; no warning raised or logged while
    loading (SkyRL#1680, vllm#48284, prime-rl#2714).
``atomic_update``
    An update that fails mid-stream (:data:`FAILURES`: a refused bucket, an exception in the
    sender, a lost rank) leaves the old version bit for bit or the engine marked unusable
    (``end_update`` refuses to complete it, or ``weight_version`` is ``None``) - never a silent
    mix, never a version moved; the next full update is bit-exact (tokenspeed#672,
    NeMo-RL#2444).
``lifecycle``
    Misuse of the session (:data:`PROBES`) is refused with an error or handled as documented,
    and never corrupts: the parameters and the version say what happened, and the next full
    update lands.
``coverage_by_rank``
    Every engine rank of :data:`ENGINE_REPLICAS` engines (and every MoE-DP replica inside each)
    updated, their buckets interleaved; ranks holding the same shard bit-identical; the ranks
    the check covered recorded (``dp:ep:tp`` keys, as vLLM's weight checker returns them).
``version``
    ``weight_version`` moves exactly once per completed update (an identity update included),
    never at ``begin_update`` or a bucket, never by a failed update.
``lifecycle``, sleep and wake (claimed ``sleep``)
    Between updates the engine gives its weights' memory back (:data:`SLEEP_LEVELS`): after a
    level-1 ``sleep`` and ``wake_up`` every parameter holds its bits at its address, the version
    unmoved, and the next update lands; after a level-2 one (weights discarded) no complete
    version is claimed, an update that stops short is refused or leaves the engine marked
    unusable, and the next complete update lands.

Expected states come from the oracle (:func:`suites.harness.inputs.expected`, the synthetic
value function at layout coordinates), never from the loader; "unchanged" is the engine's
own bits before the step, snapshotted.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Optional

from pytest_weightsync import compare
from pytest_weightsync.deadline import CallTimeoutError
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import (
    fused_name,
    parse_receiver_name,
    receiver_shard,
)
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.vocabulary import BUCKET_LIMITS

from . import calls, claims, diagnosis, inputs, judge
from .cases import ENGINE_REPLICAS
from .memo import memo
from .judge import ConformanceError

#: Identity syncs after the first update (the issue's N >= 3).
IDENTITY_SYNCS = 3
#: How an update fails mid-stream.
FAILURES = ("refused_bucket", "sender_exception", "lost_rank")
#: Misuse of the session the ``lifecycle`` property probes.
PROBES = ("outside_session", "double_begin", "end_without_begin", "begin_after_failure")
#: Sleep levels (vLLM's: 1 offloads the weights to host memory, 2 discards them).
SLEEP_LEVELS = (1, 2)
#: Tokens of the fixed forward input.
FORWARD_TOKENS = 5


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


def engine_side(impl) -> bool:
    """Whether ``impl`` frames updates itself (defines ``begin_update`` and ``end_update``)."""
    return all(callable(getattr(impl, m, None)) for m in ("begin_update", "end_update"))


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


def _kind(name: str) -> str:
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


class EngineRank:
    """One engine rank's parameters (poisoned, as an engine allocates them) and the loader
    under test, called the way the engine's update path calls it."""

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

    def not_moved(self, what: str, *, bits_unchanged: Optional[bool], new: int = 2) -> object:
        """Where no update completed (mid-update, after a failure or a refused call): the
        version is the last complete one or ``None``; after a step that ended (a failure, a
        refused call) the last one only while the parameters still hold it bit for bit
        (``bits_unchanged=None``: mid-update, where an engine may keep saying the last one
        until the update completes). Returns what it said."""
        if not self.versioned:
            return None
        now = self.version()
        if now is None:
            return now
        if now != self.last_version:
            raise ConformanceError(
                f"version published without a completed update: weight_version moved "
                f"{self.last_version!r} -> {now!r} at {what} on {self.where} (it may move only "
                f"when an update completes, never mid-update or for a failed one; tokenspeed#672: "
                f"a version published after a failed chunk)")
        if bits_unchanged is False:
            raise ConformanceError(
                f"partial advance: weight_version still says {now!r} (a complete version) at "
                f"{what} on {self.where}, while the parameters no longer hold it: "
                f"{self.mix_summary(new)} (NeMo-RL#2444: a failed sync left the weights partly "
                f"advanced; answer None until a full update)")
        return now

    def mix_summary(self, new: int = 2) -> str:
        """How the parameters mix what they held before the step (:attr:`before_step`) and
        version ``new``."""
        old = self.before_step
        expected = inputs.expected(self.case, self.rank, new)
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
            parts.append(f"{name}: {moved} element(s) hold version {new}, {stayed} still the "
                         f"previous one")
        if not parts:
            return "no parameter changed"
        return "; ".join(parts[:4]) + (f"; ... ({len(parts)} parameters)" if len(parts) > 4
                                       else "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# identity
# --------------------------------------------------------------------------------------------


def forward(case, rank: int, params) -> "torch.Tensor":
    """The reference MoE forward of ``rank``'s experts on a fixed input, every layer stacked
    ``[L, T, H]`` (float32): read from the engine's parameters in its layout
    (:func:`~pytest_weightsync.reference_impl.model.engine_layout.checkpoint_view`)."""
    import torch

    from pytest_weightsync.reference_impl.oracle.moe_forward import moe_forward

    spec, topo = case.spec, case.receiver
    shard = receiver_shard(spec, topo, rank)
    view = engine_layout.checkpoint_view(spec, topo, rank, {
        name: t for name, t in params.items() if parse_receiver_name(name) is not None})
    gen = torch.Generator().manual_seed(20260937)
    hidden = torch.randn(FORWARD_TOKENS, spec.hidden, generator=gen).to(spec.dtype)
    outs = []
    for layer in range(spec.num_layers):
        logits = torch.randn(FORWARD_TOKENS, spec.num_experts, generator=gen)
        outs.append(moe_forward(hidden, logits, view[fused_name(layer, "w13")],
                                view[fused_name(layer, "w2")], top_k=min(2, spec.num_experts),
                                expert_start=shard.experts.start, order=topo.order,
                                out_dtype=torch.float32))
    return torch.stack(outs)


def _forward_difference(got, want) -> Optional[str]:
    found = compare.first_difference(got, want)
    if found is None:
        return None
    count, index, _ = found
    return (f"{count} of {got.numel()} outputs differ, first at layer={index[0]} "
            f"token={index[1]} col={index[2]}: got {float(got[index])!r}, expected "
            f"{float(want[index])!r}")


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


def _named(error: ConformanceError, engine: EngineRank, version: int,
           what: str) -> ConformanceError:
    """``error`` (a failed judgement of ``version``) headed by the lifecycle pattern it shows
    when one is recognized, else by ``what`` happened."""
    timing = post_load_timing(engine, version)
    head = f"{timing} - {what}" if timing else what
    return ConformanceError(f"{head}\n{error}", error.mismatch)


#: The version the identity syncs send. Their weights are the oracle's FINITE values (normal
#: BF16 numbers of moderate exponent, ``synth.full_weights(finite=True)``): a forward over the
#: full bit patterns (infinities, NaNs) is NaN everywhere and would not see a changed weight.
IDENTITY_VERSION = 1


@memo(8)
def identity_weights(spec):
    """The full weights every identity sync sends (read only)."""
    return synth.full_weights(spec, IDENTITY_VERSION, finite=True)


@memo(32)
def identity_expected(case, rank: int) -> dict:
    """What ``rank`` holds after an update of :func:`identity_weights`, in the engine's layout
    (the oracle at layout coordinates; read only)."""
    spec, topo = case.spec, case.receiver
    if topo.default_engine:
        return synth.expected_receiver_params(spec, topo, rank, IDENTITY_VERSION, finite=True)
    return synth.expected_engine_params(spec, topo, rank, IDENTITY_VERSION, finite=True)


def _identity_update(engine: EngineRank, bucket) -> None:
    engine.begin()
    for piece in inputs.stream(engine.fmt, engine.case, engine.rank,
                               full=identity_weights(engine.case.spec), bucket=bucket):
        engine.load(piece)
    engine.end()


def _identity_mismatch(engine, name, want, before, what) -> ConformanceError:
    """The located difference of ``name`` from ``want``, headed by the pattern it shows."""
    case, rank = engine.case, engine.rank
    try:
        compare.assert_bitwise_equal(engine.params[name], want, name=name, rank=rank,
                                     locate=inputs.locator(case, rank))
    except compare.BitMismatchError as error:
        hint = post_load_timing(engine, IDENTITY_VERSION, finite=True)
        if hint is not None and hint in what:
            hint = None  # it heads the message already
        elif hint is None and case.receiver.default_engine:
            hint = diagnosis.diagnose(name, engine.params[name], want, case, rank,
                                      before.records[name].copy if before else None)
        return ConformanceError(f"{what}\n" + (f"{hint}\n" if hint else "") + str(error),
                                error)
    raise AssertionError(f"{name} equals what it was compared with (a harness bug)")


def check_identity(impl, case, fmt: str) -> None:
    """Every rank: one update to :func:`identity_weights`, then :data:`IDENTITY_SYNCS`
    identity syncs of them, each a full framed update at another bucket limit (see the
    module docstring)."""
    for rank in range(case.receiver.world_size):
        engine = EngineRank(impl, case, rank, fmt)
        _identity_update(engine, "split_layer")
        compare.assert_same_storage(engine.poisoned, engine.params, rank=rank)
        expected = identity_expected(case, rank)
        for name, record in engine.poisoned.records.items():
            want = expected.get(name, record.copy)  # the router weight: untouched
            if not compare.same_bits(engine.params[name], want):
                timing = post_load_timing(engine, IDENTITY_VERSION, finite=True)
                raise _identity_mismatch(engine, name, want, engine.poisoned, (
                    f"{timing} - " if timing else "") + f"the first update, before any "
                    f"identity sync, did not land on {engine.where}")
        held = compare.snapshot(engine.params)
        want = forward(case, rank, expected)  # over the oracle's weights
        first = forward(case, rank, engine.params)
        assert compare.same_bits(first, want) and bool(want.abs().sum() > 0), (
            f"the forward over {engine.where}'s bit-exact weights is zero or differs from the "
            f"forward over the oracle's: {_forward_difference(first, want)} (a harness bug)")
        for sync in range(1, IDENTITY_SYNCS + 1):
            with load_warnings() as caught:
                _identity_update(engine, BUCKET_LIMITS[sync % len(BUCKET_LIMITS)])
            compare.assert_same_storage(held, engine.params, rank=rank)
            moved = changed(held, engine.params)
            if moved:
                raise _identity_failure(engine, sync, moved, held, want)
            if caught:
                raise ConformanceError(
                    f"identity sync {sync} of {IDENTITY_SYNCS} on {engine.where} left every bit "
                    f"as it was but warned while loading ({len(caught)}): {caught[:3]} - a sync "
                    f"of the engine's own weights must load without a warning (SkyRL's "
                    f"regression: no 'Failed to load weights')")


def _identity_failure(engine, sync, moved, held, want) -> ConformanceError:
    case, rank = engine.case, engine.rank
    fwd = _forward_difference(forward(case, rank, engine.params), want)
    fused = [n for n in moved if n.endswith("w13_weight")]
    head = post_load_timing(engine, IDENTITY_VERSION, finite=True) or (
        f"identity sync corrupted a fused parameter: {_kind(fused[0])}" if fused
        else f"identity sync corrupted {_kind(moved[0])}")
    name = (fused or moved)[0]
    return _identity_mismatch(engine, name, held.records[name].copy, held, (
        f"{head} - identity sync {sync} of {IDENTITY_SYNCS} (the engine's own weights sent "
        f"back) changed {len(moved)} of {len(held.records)} parameter(s) of {engine.where}: "
        f"{[_kind(n) for n in moved[:4]]}; the forward on a fixed input "
        f"{'changed: ' + fwd if fwd else 'did not change'} (SkyRL#1680, vllm#48284, "
        f"prime-rl#2714)"))


# --------------------------------------------------------------------------------------------
# atomic_update and lifecycle: a failed update, misuse of the session
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


def _start(impl, case, fmt) -> EngineRank:
    """The last rank of ``case`` holding a complete version 1 (judged), its version read."""
    engine = EngineRank(impl, case, case.receiver.world_size - 1, fmt)
    engine.update(1)
    engine.check(1)
    engine.completed("the first update")
    return engine


def _refused(what: str, run) -> None:
    """Run ``run`` (the calls of an update the engine must take); an error from it is a
    conformance failure headed by ``what``."""
    error = attempt(run)
    if error is not None:
        raise ConformanceError(f"{what}: {judge.quoted(error, 600)}")


def _recover(engine: EngineRank, version: int, after: str) -> None:
    """The next full update lands bit-exact and moves the version once."""
    _refused(f"stuck after {after}: the next full update was refused on {engine.where}",
             lambda: engine.update(version))
    try:
        engine.check(version, previous_version=1)
    except ConformanceError as error:
        raise _named(error, engine, version,
                     f"the full update after {after} did not land on {engine.where}") from None
    engine.completed(f"the full update after {after}")


def check_atomic(impl, case, fmt: str, failure: str) -> None:
    """Version 2 fails at :func:`failure_point` by ``failure``; judged as the module says;
    then version 3 in full."""
    engine = _start(impl, case, fmt)
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
            end_error = attempt(engine.end)
            if end_error is None and not engine.says_no_version():
                raise ConformanceError(
                    f"silent mix: {impl.name} accepted a bad bucket at {at} ({what}) and "
                    f"completed the update on {engine.where}: {engine.mix_summary()} - a loader "
                    f"that claims 'atomic' refuses a bucket it cannot load, and the update fails")
        else:
            end_error = attempt(engine.end)  # the sender's `finally`
    elif failure == "sender_exception":  # the sender raised before bucket `cut`; its
        end_error = attempt(engine.end)    # `finally` ends the session
    elif failure != "lost_rank":  # lost rank: the buckets stop, nothing ends the session
        raise ValueError(f"unknown failure {failure!r}; expected one of {FAILURES}")
    bits_old = not changed(old, engine.params)
    engine.not_moved(f"an update that failed at {at} ({failure})", bits_unchanged=bits_old)
    marked = end_error is not None or engine.says_no_version()
    if not bits_old and not marked and failure != "lost_rank":
        raise ConformanceError(
            f"silent mix: end_update completed an update that failed at {at} ({failure}) on "
            f"{engine.where}, and nothing marks the engine unusable: {engine.mix_summary()} "
            f"(an atomic engine keeps the old bits, refuses the end_update, or says None in "
            f"weight_version until a full update; NeMo-RL#2444, tokenspeed#672)")
    _recover(engine, 3, f"an update that failed at {at} ({failure})")


def check_probe(impl, case, fmt: str, probe: str) -> None:
    """Misuse ``probe`` of a session on an engine holding version 1 (see the module)."""
    engine = _start(impl, case, fmt)
    held = engine.before_step = compare.snapshot(engine.params)
    if probe == "end_without_begin":
        error = attempt(engine.end)
        _unchanged(engine, held, "an end_update without begin_update", error)
        engine.not_moved("an end_update without begin_update", bits_unchanged=True)
        _recover(engine, 3, "an end_update without begin_update")
    elif probe == "outside_session":
        _outside_session(engine, held)
        _recover(engine, 3, "a bucket loaded outside a session")
    elif probe == "double_begin":
        stream = engine.stream(2)
        half = max(1, len(stream) // 2)
        engine.begin()
        for piece in stream[:half]:
            engine.load(piece)
        error = attempt(engine.begin)
        how = "accepted (the update restarted)" if error is None else (
            f"refused ({judge.quoted(error, 200)}; the open update went on)")

        def rest():
            for piece in (stream if error is None else stream[half:]):  # restarted, or goes on
                engine.load(piece)
            engine.end()
        _refused(f"a second begin_update was neither refused nor a restart: after it was {how}, "
                 f"the update could not complete on {engine.where}", rest)
        try:
            engine.check(2, before=engine.poisoned, previous_version=1)
        except ConformanceError as failure:
            raise _named(failure, engine, 2, f"after a second begin_update, {how}, the update "
                                             f"did not land on {engine.where}") from None
        engine.completed(f"an update with a second begin_update {how.split(' (')[0]}")
    elif probe == "begin_after_failure":
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
        _refused(f"stuck after a failed update: the update begun after it (at bucket {cut}) "
                 f"could not complete on {engine.where}", rest)
        try:
            engine.check(3, previous_version=1)
        except ConformanceError as failure:
            raise _named(failure, engine, 3, f"the update begun after a failed one did not "
                                             f"land on {engine.where}") from None
        engine.completed("the update begun after a failed one")
    else:
        raise ValueError(f"unknown probe {probe!r}; expected one of {PROBES}")


def _unchanged(engine, held, what: str, error) -> None:
    moved = changed(held, engine.params)
    if not moved:
        return
    try:
        engine.check(1, before=held)
        located, mismatch = "", None
    except ConformanceError as failure:
        located, mismatch = str(failure), failure.mismatch
    said = f"raised {judge.quoted(error, 200)} but " if error is not None else ""
    raise ConformanceError(f"misuse corrupted the weights: {what} {said}changed {len(moved)} "
                           f"parameter(s) of {engine.where}: {[_kind(n) for n in moved[:4]]} - "
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


# --------------------------------------------------------------------------------------------
# sleep and wake between updates
# --------------------------------------------------------------------------------------------


def check_sleep(impl, case, fmt: str, level: int) -> None:
    """An engine holding version 1 sleeps at ``level`` and wakes; judged as the module says."""
    engine = _start(impl, case, fmt)
    held = engine.before_step = compare.snapshot(engine.params)
    kwargs = dict(spec=case.spec, topology=case.receiver, rank=engine.rank)
    _refused(f"sleep(level={level}) was refused on {engine.where}",
             lambda: calls.call(impl, "sleep", engine.params, level=level, **kwargs))
    _refused(f"wake_up after sleep(level={level}) was refused on {engine.where}",
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
                f"{[_kind(n) for n in moved[:4]]} - level 1 offloads the weights and wake_up "
                f"restores every bit at its address (vLLM's sleep level 1)\n{located}", mismatch)
        engine.not_moved(what, bits_unchanged=True)
        _recover(engine, 2, what)
        return
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
    error = attempt(engine.end)
    if error is None and not engine.says_no_version():
        raise ConformanceError(
            f"partial update accepted after a level-2 sleep: end_update completed an update of "
            f"{cut} of {len(stream)} buckets on {engine.where} after {what}, and nothing marks "
            f"the engine unusable - what no bucket carried holds whatever the discarded memory "
            f"held (after level 2 the next update must be complete)")
    _recover(engine, 3, f"{what} and an update that stopped short")


# --------------------------------------------------------------------------------------------
# version
# --------------------------------------------------------------------------------------------


def check_version(impl, case, fmt: str) -> None:
    """On the last rank: version 1; version 2 read after ``begin_update``, after every bucket
    and after ``end_update``; version 2 again (an identity update: a completed update too);
    version 3 abandoned mid-stream by the sender (``end_update`` in its ``finally``); version
    4 in full. Each completed update moves the version exactly once, nothing else moves it."""
    engine = _start(impl, case, fmt)
    stream = engine.stream(2, bucket="tensor")
    engine.begin()
    engine.not_moved("begin_update", bits_unchanged=None)
    for index, piece in enumerate(stream):
        engine.load(piece)
        engine.not_moved(f"bucket {index} of {len(stream)} (before end_update)",
                         bits_unchanged=None)
    engine.end()
    engine.completed("update 2")
    engine.update(2, bucket="multi_layer")
    engine.completed("an identity update (version 2 sent again)")
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


# --------------------------------------------------------------------------------------------
# coverage_by_rank
# --------------------------------------------------------------------------------------------


def rank_key(case, replica: int, rank: int) -> str:
    """``replica:dp:ep:tp`` of an engine rank (vLLM's checker keys tensors ``dp:pp:pcp:tp:ep``)."""
    shard = receiver_shard(case.spec, case.receiver, rank)
    return (f"r{replica}:dp{shard.moe_dp_rank}:ep{shard.moe_ep_rank}:tp{shard.moe_tp_rank}"
            f"=rank{rank}")


def check_coverage(impl, case, fmt: str, record=None) -> str:
    """Every rank of :data:`ENGINE_REPLICAS` engines updated to version 1 with their buckets
    interleaved (every session open at once), judged against the oracle; ranks holding the
    same shard (MoE-DP replicas, engine replicas) bit-identical. Returns (and ``record`` s)
    the covered ranks."""
    world = case.receiver.world_size
    engines = [EngineRank(impl, case, rank, fmt)
               for _ in range(ENGINE_REPLICAS) for rank in range(world)]
    streams = [e.stream(1, bucket=BUCKET_LIMITS[i % len(BUCKET_LIMITS)])
               for i, e in enumerate(engines)]
    keys = [rank_key(case, i // world, e.rank) for i, e in enumerate(engines)]

    def step(i, what, call, *args):
        error = attempt(call, *args)
        if error is not None:
            raise ConformanceError(
                f"sessions interfere: {keys[i]} refused its {what} while the sessions of every "
                f"other rank and replica were open and their buckets interleaved (a loader "
                f"keeps one session per parameter set): {judge.quoted(error, 600)}")
    for i, engine in enumerate(engines):
        step(i, "begin_update", engine.begin)
    for index in range(max(map(len, streams))):
        for i, (engine, stream) in enumerate(zip(engines, streams)):
            if index < len(stream):
                step(i, f"bucket {index}", engine.load, stream[index])
    for i, engine in enumerate(engines):
        step(i, "end_update", engine.end)
    failures, covered = {}, []
    for i, engine in enumerate(engines):
        key = keys[i]
        try:
            engine.check(1)
            covered.append(key)
        except ConformanceError as error:
            failures[i] = (key, error)
    report = (f"{len(covered)} of {len(engines)} engine ranks ({ENGINE_REPLICAS} engines x "
              f"{world} ranks, moe_dp {case.receiver.moe_dp}) hold the update: "
              f"{', '.join(covered) or 'none'}")
    if record is not None:
        record(report)
    groups: dict = {}
    for i, engine in enumerate(engines):
        shard = receiver_shard(case.spec, case.receiver, engine.rank)
        groups.setdefault((shard.moe_ep_rank, shard.moe_tp_rank), []).append(i)
    for members in groups.values():
        ref = members[0]
        for other in members[1:]:
            a, b = engines[ref], engines[other]
            differ = [n for n in a.params if not compare.same_bits(a.params[n], b.params[n])]
            if differ:
                raise _replica_failure(case, engines, failures, ref, other, differ, report)
    if failures:
        i, (key, error) = next(iter(failures.items()))
        raise ConformanceError(f"rank not covered: {key} did not receive the update - "
                               f"{report}\n{error}", error.mismatch)
    return report


def _replica_failure(case, engines, failures, ref, other, differ, report) -> ConformanceError:
    world = case.receiver.world_size
    a, b = engines[ref], engines[other]
    # name the one that still holds what it held before the update, if one does
    for lagging, peer in ((other, ref), (ref, other)):
        e = engines[lagging]
        stale = [n for n in differ if compare.same_bits(e.params[n], e.poisoned.records[n].copy)]
        if stale and lagging in failures and peer not in failures:
            key, error = failures[lagging]
            holder = rank_key(case, peer // world, engines[peer].rank)
            return ConformanceError(
                f"replica skipped: {key} never received the update - {stale[:2]} still hold "
                f"their bits from before it, while {holder} of the same shard holds it; every "
                f"replica must be written - {report}\n{error}", error.mismatch)
    first = failures.get(other) or failures.get(ref)
    return ConformanceError(
        f"replicas differ: {rank_key(case, ref // world, a.rank)} and "
        f"{rank_key(case, other // world, b.rank)} hold the same shard but {differ[:3]} differ "
        f"- {report}" + (f"\n{first[1]}" if first else ""),
        first[1].mismatch if first else None)
