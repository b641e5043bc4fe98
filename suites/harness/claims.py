"""What an implementation claims, and what the suites do with a case it does not claim.

A case outside an implementation's ``Capabilities`` is skipped with the reason - never passed.
Such a skip is raised as :class:`NotClaimed` (or :class:`NotApplicable`, for a property that
has nothing to check on this implementation, e.g. fallback routing when nothing can be routed)
so the report can tell it from a case the implementation claims but that could not run here (a
missing package, a GPU test on CPU): only the latter keeps the verdict from PASS.

Two refusals are told apart, because a property the implementation claims must run somewhere:
what it does not claim at all (an engine feature - a post-load layout, redundant experts, FP8 -
whole models, a lifecycle part, a transport) is :class:`NotClaimed`; a case of what it claims
that lies outside its declared topologies, trainer layouts, formats or deliveries is
:class:`OutsideClaims`. A property whose every case is the latter never ran for the
implementation, and its verdict says so (``pytest_weightsync.verdict``).

Fallback routing lives here too: with one capability taken away, path selection
(``pytest_weightsync.reference_impl.senders.select``) must route a ``direct`` update down a path the
implementation claims.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.senders.select import Capabilities as RoutingCapabilities
from pytest_weightsync.reference_impl.senders.select import NoCompatiblePathError, select_path
from pytest_weightsync.vocabulary import SKIP_NOT_APPLICABLE, SKIP_OUTSIDE, SKIP_UNCLAIMED


class NotClaimed(pytest.skip.Exception):
    """Skip: the implementation does not claim this case (its capabilities say so)."""

    __module__ = "builtins"  # shown as "NotClaimed: reason", like pytest's own "Skipped"
    kind = SKIP_UNCLAIMED


class OutsideClaims(NotClaimed):
    """Skip: the implementation claims what the test checks, but not this case (a topology,
    trainer layout, format or delivery outside the ones it declares)."""

    __module__ = "builtins"
    kind = SKIP_OUTSIDE


class NotApplicable(pytest.skip.Exception):
    """Skip: the property has nothing to check for this implementation on this case."""

    __module__ = "builtins"
    kind = SKIP_NOT_APPLICABLE


def refusal(impl, role, case, fmt=None, delivery=None):
    """``(reason, outside)``: why ``impl`` (in ``role``: ``loader``, ``exporter``,
    ``distributed_exporter``) is not run on ``case`` (and ``fmt``, ``delivery``), or ``(None,
    False)`` when it claims all of them. ``outside`` is true when the refusal is a case outside
    the topologies, trainer layouts, formats or deliveries it declares, false when it is an
    engine feature it does not claim (post-load layout, redundant experts, quantization), which
    is checked first. Exporters must also claim the case's trainer layout (expert modules,
    parallel sizes)."""
    caps = impl.capabilities
    side = "loader" if role == "loader" else "exporter"
    feature = caps._engine_refusal(case.receiver)  # the claims topology_refusal starts with
    reason = caps.topology_refusal(side, case.spec, case.receiver)
    if reason is None and side == "exporter":
        reason = caps.trainer_refusal(case.spec, case.trainer)
    if reason is None and delivery is not None:
        reason = caps.delivery_refusal(delivery)
    if reason is None and fmt is not None:
        reason = caps.format_refusal(side, fmt, case.receiver)
    if reason is None:
        return None, False
    return f"{impl.name} {reason}", feature is None


def unclaimed(impl, role, case, fmt=None, delivery=None):
    """Why ``impl`` (in ``role``) is not run on ``case`` (and ``fmt``, ``delivery``), or
    ``None`` when it claims all of them (:func:`refusal`'s reason)."""
    return refusal(impl, role, case, fmt, delivery)[0]


def model_unclaimed(impl, role, case, fmt=None):
    """:func:`unclaimed` for a whole-model case (``suites/harness/model_cases.ModelCase``):
    the implementation must also claim every parameter group of the model and the targets
    the update reaches (``Capabilities.model_refusal``)."""
    reason = impl.capabilities.model_refusal(case.spec, case.targets)
    if reason is not None:
        return f"{impl.name} {reason}"
    return unclaimed(impl, role, case, fmt)


def require_model_claim(impl, role, case, fmt=None) -> None:
    """Skip the calling test as not claimed unless ``impl`` claims the whole-model ``case``."""
    reason = model_unclaimed(impl, role, case, fmt)
    if reason is not None:
        skip_unclaimed(reason)


def skip_unclaimed(reason: str):
    """Skip the calling test as not claimed, with ``reason``."""
    raise NotClaimed(reason, pytrace=False)


def skip_not_applicable(reason: str):
    """Skip the calling test as not applicable, with ``reason``."""
    raise NotApplicable(reason, pytrace=False)


def skip_outside(reason: str):
    """Skip the calling test as a case outside the claims of a claimed property (see the
    module docstring), with ``reason``."""
    raise OutsideClaims(reason, pytrace=False)


def require_claim(impl, role, case, fmt=None, delivery=None) -> None:
    """Skip the calling test, with the reason, unless ``impl`` claims ``case`` (and ``fmt``,
    ``delivery``): as outside the claims (:class:`OutsideClaims`) when the case lies outside
    its declared topologies, layouts, formats or deliveries, else as not claimed."""
    reason, outside = refusal(impl, role, case, fmt, delivery)
    if reason is not None:
        (skip_outside if outside else skip_unclaimed)(reason)


def claimed_formats(impl, role, case, formats):
    """The formats of ``formats`` that ``impl`` claims on ``case``'s receiver, in that order."""
    side = "loader" if role == "loader" else "exporter"
    return [f for f in formats
            if impl.capabilities.format_refusal(side, f, case.receiver) is None]


# --- fallback routing -------------------------------------------------------------------------


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


def fallback_choice(impl, role, case, restriction):
    """Route a ``direct`` update of ``impl`` with one capability taken away (``restriction``).

    Not applicable (skipped as such) when the restriction does not apply to ``case`` or leaves
    no claimed path - an implementation that claims one format has nothing to fall back to;
    otherwise returns the routing choice after asserting it fell back from ``direct`` to a path
    ``impl`` claims. Shared by the loader and exporter ``fallback_routing`` properties.
    """
    require_claim(impl, role, case)
    caps, why_not = RESTRICTIONS[restriction](impl.capabilities.routing(role), case.receiver)
    if caps is None:
        skip_not_applicable(why_not)
    try:
        choice = select_path("direct", caps, case.receiver)
    except NoCompatiblePathError as error:
        skip_not_applicable(f"{impl.name} claims no path left with {restriction}: {error}")
    assert choice.fell_back and choice.skipped[0][0] == "direct", choice
    assert choice.path in caps.formats, f"routed to {choice.path}, not claimed: {choice}"
    return choice
