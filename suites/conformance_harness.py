"""Driving an implementation under test through one scenario, and judging the result.

The conformance suites hand implementations (``pytest_weightsync.protocols``) payloads built
by the reference sender paths from synthetic weights, and judge every receiver rank against
the state computed independently from the synthetic value function
(``synth.expected_receiver_params``) - never against the implementation's own output. A
mismatch is reported with its first differing (layer, expert, projection, row, col) and, when
the pattern is a known bug, a first line naming it (gate/up halves swapped, stale values,
elements never written, padding not zeroed).
"""

from __future__ import annotations

import functools

import pytest

from . import harness
from pytest_weightsync import compare
from pytest_weightsync.reference_impl import synth
from pytest_weightsync.reference_impl.layout import receiver_param_shapes, receiver_shard
from pytest_weightsync.reference_impl.select import Capabilities as RoutingCapabilities
from pytest_weightsync.reference_impl.select import NoCompatiblePathError, select_path

FORMATS = ("compat", "hf_fused", "packed", "direct")
#: The bucket limit a full update is cut at unless a test says otherwise: a layer's experts
#: straddle buckets, as in real senders' streams.
DEFAULT_BUCKET = "split_layer"
#: A parameter every real receiver also holds (the MoE router); loaders must leave it alone.
SENTINEL = "model.layers.0.mlp.gate.weight"


class ConformanceError(AssertionError):
    """An implementation's result differs from the reference; the message says where and,
    when recognizable, which bug it looks like."""


# --- inputs ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _gathered(case, version):
    return harness.gathered_weights(case, version)


@functools.lru_cache(maxsize=256)
def _expected(case, rank, version):
    return synth.expected_receiver_params(case.spec, case.receiver, rank, version)


def payload(fmt, case, rank, version, layers=None):
    """The ``fmt`` payload of ``version`` for receiver ``rank``, as fresh tensors (an
    implementation that scribbles on its input cannot corrupt the next test's input)."""
    chunk = harness.payload(fmt, case, rank, _gathered(case, version), layers)
    return [(name, tensor.clone()) for name, tensor in chunk]


def stream(fmt, case, rank, version, layers=None, *, bucket_bytes=DEFAULT_BUCKET):
    """:func:`payload` cut into buckets at ``bucket_bytes`` (a name of
    ``harness.BUCKET_LIMITS``, an int, or ``None`` for one bucket)."""
    from pytest_weightsync.reference_impl.buckets import split_buckets

    return split_buckets(payload(fmt, case, rank, version, layers),
                         harness.bucket_bytes(bucket_bytes, case.spec))


def receiver_params(case, rank):
    """Receiver ``rank``'s pre-allocated parameters: the expert ``w13``/``w2`` of every layer
    plus a router weight, all poisoned (nothing passes by luck of a zero buffer)."""
    import torch

    spec = case.spec
    params = {name: torch.empty(shape, dtype=spec.dtype)
              for name, shape in receiver_param_shapes(spec, case.receiver, rank).items()}
    params[SENTINEL] = torch.empty(spec.num_experts, spec.hidden, dtype=spec.dtype)
    for tensor in params.values():
        synth.poison_(tensor)
    return params


def load(impl, params, fmt, case, rank, version, layers=None, *, bucket_bytes=DEFAULT_BUCKET):
    """Send ``version`` to ``impl`` as a bucket stream cut at ``bucket_bytes``, one
    ``load_weights`` call per bucket. A full update (``layers=None``) is framed by the loader's
    optional ``begin_update`` / ``end_update`` hooks (``pytest_weightsync.protocols``); a
    partial one (``layers`` given) is not an update of the whole model, so it is sent without
    them."""
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank)
    framed = layers is None
    begin = getattr(impl, "begin_update", None) if framed else None
    end = getattr(impl, "end_update", None) if framed else None
    if callable(begin):
        begin(params, **kwargs)
    for bucket in stream(fmt, case, rank, version, layers, bucket_bytes=bucket_bytes):
        impl.load_weights(params, bucket, **kwargs)
    if callable(end):
        end(params, **kwargs)


# --- judging -----------------------------------------------------------------------------------


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool((compare.raw_bits(a) == compare.raw_bits(b)).all())


def diagnose(name, actual, expected, case, rank, before=None, previous=None):
    """A one-line name for a recognizable wrong result of parameter ``name``, else ``None``."""
    if before is not None and _same_bits(actual, before):
        return "never written: it still holds the bits it held before the update"
    if previous is not None and _same_bits(actual, previous):
        return "stale: it still holds the previous version's values, not the new ones"
    shard = receiver_shard(case.spec, case.receiver, rank)
    buf, rows = shard.buffer_rows, shard.rows
    if name.endswith("w13_weight") and rows > 0:
        first, second = ("gate", "up") if case.receiver.order == "gate_up" else ("up", "gate")
        a_first, a_second = actual[:, :rows], actual[:, buf:buf + rows]
        e_first, e_second = expected[:, :rows], expected[:, buf:buf + rows]
        swapped = [slot for slot in range(actual.shape[0])
                   if _same_bits(a_first[slot], e_second[slot])
                   and _same_bits(a_second[slot], e_first[slot])]
        if swapped:
            experts = [shard.experts[s] for s in swapped]
            return (f"gate/up halves swapped: the {first} rows of w13 hold {second}_proj values "
                    f"and the {second} rows hold {first}_proj values (receiver order "
                    f"{case.receiver.order!r}; {len(swapped)} of {actual.shape[0]} local experts, "
                    f"e.g. expert {experts[0]})")
    if buf > rows:
        if name.endswith("w2_weight"):
            real_ok = _same_bits(actual[:, :, :rows], expected[:, :, :rows])
        else:
            real_ok = (_same_bits(actual[:, :rows], expected[:, :rows])
                       and _same_bits(actual[:, buf:buf + rows], expected[:, buf:buf + rows]))
        if real_ok:
            return f"padding not zeroed: the real rows are right, the tail beyond {rows} is not"
    return None


def _fail(error, name, actual, expected, case, rank, before=None, previous=None):
    hint = diagnose(name, actual, expected, case, rank, before, previous)
    head = f"{hint}\n" if hint else ""
    raise ConformanceError(f"{head}{error}") from None


def check_rank(params, case, rank, version, before, touched=None, previous_version=None):
    """Receiver ``rank`` after loading ``version`` into the parameters in ``touched`` (default
    every expert parameter): every parameter at its old address, the touched ones bit-identical
    to the expected state, every other one (the router weight included) bit-identical to
    ``before``."""
    compare.assert_same_storage(before, params, rank=rank)
    expected = _expected(case, rank, version)
    touched = list(expected) if touched is None else list(touched)
    locate = harness.locator(case, rank)
    for name in touched:
        try:
            compare.assert_bitwise_equal(params[name], expected[name], name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            previous = (_expected(case, rank, previous_version)[name]
                        if previous_version is not None else None)
            _fail(error, name, params[name], expected[name], case, rank,
                  before.records[name].copy, previous)
    for name, record in before.records.items():
        if name in touched:
            continue
        try:
            compare.assert_bitwise_equal(params[name], record.copy, name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            raise ConformanceError(f"wrote outside the payload: {name} was not in it and "
                                   f"changed\n{error}") from None


def check_receiver(receiver, case, version, before):
    """The reference receiver ``receiver`` after an exported payload of ``version``."""
    check_rank(receiver.params, case, receiver.rank, version, before)


def export_and_check(exporter, case, fmt, version, ranks=None):
    """Export ``version`` for each receiver rank in ``ranks`` (default all; one call per rank),
    checking after EVERY call that no trainer shard changed - before the receiver's values are
    judged, so the failure names the call that did it - then load the stream into a fresh
    reference receiver of that rank and judge it."""
    from pytest_weightsync import distributed
    from pytest_weightsync.protocols import as_stream
    from pytest_weightsync.reference_impl import trainer

    states = trainer.trainer_states(case.spec, case.trainer,
                                    synth.full_weights(case.spec, version))
    shards_before = [distributed.snapshot(state) for state in states]
    receivers = harness.fresh_receivers(case)
    for receiver in (receivers if ranks is None else [receivers[r] for r in ranks]):
        before = compare.snapshot(receiver.params)
        chunk = exporter.export_weights(states, format=fmt, spec=case.spec, trainer=case.trainer,
                                        receiver=case.receiver, rank=receiver.rank)
        for rank, (shards, state) in enumerate(zip(shards_before, states)):
            where = distributed.first_modification(shards, state)
            if where is not None:
                raise ConformanceError(f"export call for receiver rank {receiver.rank} "
                                       f"({fmt}) modified trainer rank {rank}'s shard {where}")
        receiver.begin_update()
        for bucket in as_stream(chunk, source=f"{exporter.name}.export_weights"):
            receiver.load(list(bucket), load_format=harness.LOAD_FORMAT[fmt])
        receiver.end_update()
        check_receiver(receiver, case, version, before)


# --- capabilities ------------------------------------------------------------------------------


def unclaimed(impl, role, case, fmt=None):
    """Why ``impl`` is not run on ``case`` (and ``fmt``), or ``None`` when it claims both. An
    exporter must also claim the case's trainer layout (expert modules, parallel sizes)."""
    caps = impl.capabilities
    reason = caps.topology_refusal(role, case.spec, case.receiver)
    if reason is None and role == "exporter":
        reason = caps.trainer_refusal(case.spec, case.trainer)
    if reason is None and fmt is not None:
        reason = caps.format_refusal(role, fmt, case.receiver)
    return None if reason is None else f"{impl.name} {reason}"


def require_claim(impl, role, case, fmt=None) -> None:
    """Skip the calling test, with the reason, unless ``impl`` claims ``case`` (and ``fmt``)."""
    reason = unclaimed(impl, role, case, fmt)
    if reason is not None:
        pytest.skip(reason)


def fallback_choice(impl, role, case, restriction):
    """Route a ``direct`` update of ``impl`` with one capability taken away (``restriction``).

    Skips when the restriction does not apply to ``case`` or leaves no claimed path; otherwise
    returns the routing choice after asserting it fell back from ``direct`` to a path ``impl``
    claims. Shared by the loader and exporter ``fallback_routing`` properties.
    """
    require_claim(impl, role, case)
    caps, why_not = RESTRICTIONS[restriction](impl.capabilities.routing(role), case.receiver)
    if caps is None:
        pytest.skip(why_not)
    try:
        choice = select_path("direct", caps, case.receiver)
    except NoCompatiblePathError as error:
        pytest.skip(f"{impl.name} claims no path left with {restriction}: {error}")
    assert choice.fell_back and choice.skipped[0][0] == "direct", choice
    assert choice.path in caps.formats, f"routed to {choice.path}, not claimed: {choice}"
    return choice


def _without(caps, **changes):
    fields = {"formats": caps.formats, "orders": caps.orders, "padded": caps.padded}
    fields.update(changes)
    return RoutingCapabilities(**fields)


#: A capability taken away from an implementation, as a change to what routing sees.
#: Each returns ``(routing capabilities, None)`` or ``(None, reason it does not apply)``.
RESTRICTIONS = {
    "direct_unsupported": lambda caps, receiver: (
        _without(caps, formats=caps.formats - {"direct"}), None),
    "fused_unsupported": lambda caps, receiver: (
        _without(caps, formats=caps.formats - {"direct", "packed"}), None),
    "order_unsupported": lambda caps, receiver: (
        _without(caps, orders=caps.orders - {receiver.order}), None),
    "padded_direct_unsupported": lambda caps, receiver: (
        (_without(caps, padded=False), None) if receiver.padded
        else (None, "the receiver is not padded: padded direct export is not needed")),
}
