"""What each implementation's claims select of the collected conformance tests.

Asked of its ``Capabilities`` at collection time, the way the suites ask at run time
(``suites/harness/claims.py``): per test, a property the implementation does not have at all
(a lifecycle part, whole models) or an engine feature it does not claim (a post-load layout,
redundant experts, quantization, uneven placement, a whole model's parameter groups or draft,
a layer spec) - ``unclaimed``; a case outside its declared topologies, trainer layouts,
deliveries or formats - ``outside``; else ``selected``. ``--weightsync-list`` shows what this
selects per implementation and property (:mod:`pytest_weightsync.listing`), the run's
selection record carries it to the JSON report (:mod:`pytest_weightsync.selection`), and the
report, at run time, uses :func:`property_refusal` to tell a case of a property the
implementation has from one of a property it does not (:mod:`pytest_weightsync.verdict`).
A test whose case is chosen at run time (no topology parameter) counts as selected here.
No torch here: the cases are already built objects.
"""

from __future__ import annotations

from typing import Optional

from pytest_weightsync import topology
from pytest_weightsync.protocols import ClaimError
from pytest_weightsync.registry import IMPL_FIXTURES, Registered, implementation_of, registered_of
from pytest_weightsync.vocabulary import FORMAT_PARAMS, FORMATS

#: Properties an implementation has only when it claims one of these parts of the update
#: lifecycle (``Capabilities.lifecycle``; ``suites/conformance/test_lifecycle.py``).
LIFECYCLE_PARTS = {"atomic_update": ("atomic",), "version": ("version",),
                   "lifecycle": ("sessions", "sleep")}
#: Properties of whole models: an implementation that claims no ``model_parts`` (an
#: expert-only one) does not have them (``suites/conformance/test_model*.py``).
WHOLE_MODEL = ("coverage", "model_bit_exact", "tied_embeddings", "targets")

#: What :func:`decide` says of one test: selected by the claims, a case outside them, or a
#: property (or engine feature) not claimed at all.
SELECTED, OUTSIDE, UNCLAIMED = "selected", "outside", "unclaimed"


def property_refusal(caps, prop: Optional[str]) -> Optional[str]:
    """Why an implementation with capabilities ``caps`` does not have property ``prop`` at all,
    whatever the case; ``None`` when it does (every property of its roles but the lifecycle
    parts and whole models it does not claim)."""
    parts = LIFECYCLE_PARTS.get(prop or "")
    if parts is not None and not set(parts) & set(caps.lifecycle):
        return caps.lifecycle_refusal(parts[0]) if len(parts) == 1 else (
            f"claims none of {list(parts)} of the update lifecycle (Capabilities.lifecycle "
            f"claims {sorted(caps.lifecycle)})")
    if prop in WHOLE_MODEL and not caps.model_parts:
        return "claims no whole-model parameters (an expert-only implementation)"
    return None


def _format_of(params: dict) -> Optional[str]:
    return next((v for k, v in params.items() if k in ("payload_format", "fmt")
                 and v in FORMATS), None)


def decide(item) -> Optional[tuple]:
    """``(verdict, reason)`` of a collected test against its implementation's claims:
    ``(SELECTED, None)``, ``(OUTSIDE, why)`` or ``(UNCLAIMED, why)``; ``None`` for a test of
    no registered implementation. The order is the suites': the property, the engine features
    and the whole model first, then topology, trainer layout, delivery and format."""
    entry = registered_of(item)
    if entry is None:
        return None
    caps = entry.obj.capabilities
    marker = item.get_closest_marker("weightsync_property")
    prop = str(marker.args[0]) if marker is not None and marker.args else None
    why = property_refusal(caps, prop)
    if why is not None:
        return UNCLAIMED, why
    params = item.callspec.params
    role = next((IMPL_FIXTURES[n] or "loader" for n in IMPL_FIXTURES
                 if isinstance(params.get(n), Registered)), "loader")
    side = "loader" if role == "loader" else "exporter"
    outer = topology.case_of(params)
    case = getattr(outer, "case", outer)
    receiver = getattr(case, "receiver", None)
    checks = [
        # engine features, whole models, layer specs: claims, not topologies
        (UNCLAIMED, lambda: caps._engine_refusal(receiver) if receiver is not None else None),
        (UNCLAIMED, lambda: caps.model_refusal(case.spec, case.targets)
         if getattr(case, "targets", None) is not None and hasattr(case.spec, "parts") else None),
        (UNCLAIMED, lambda: caps.layer_spec_refusal(outer.layer_spec)
         if isinstance(getattr(outer, "layer_spec", None), str) else None),
        # the case's topologies, trainer layout, delivery and format
        (OUTSIDE, lambda: caps.topology_refusal(side, case.spec, receiver)
         if receiver is not None else None),
        (OUTSIDE, lambda: caps.trainer_refusal(case.spec, case.trainer)
         if side == "exporter" and getattr(case, "trainer", None) is not None else None),
        (OUTSIDE, lambda: caps.delivery_refusal(outer.delivery)
         if isinstance(getattr(outer, "delivery", None), str) else None),
        (OUTSIDE, lambda: caps.format_refusal(side, _format_of(params), receiver)
         if _format_of(params) is not None else None),
    ]
    for verdict, check in checks:
        try:
            why = check()
        except ClaimError:
            raise
        except Exception:  # a case shaped otherwise: the suites decide at run time
            why = None
        if why is not None:
            return verdict, why
    return SELECTED, None


def summarize(items) -> dict:
    """``{implementation: {property: {...}}}`` of what the claims select of ``items``: per
    property ``selected`` (cases: distinct topology x format), ``topologies`` and ``formats``
    of those, and the refused ones by reason: ``outside`` (a case outside the implementation's
    declared topologies, layouts, formats or deliveries) and ``unclaimed`` (the property or an
    engine feature not claimed), each ``{reason: cases}``. JSON-able."""
    keys: dict = {}
    for item in items:
        impl = implementation_of(item)
        decided = decide(item) if impl is not None else None
        if decided is None:
            continue
        marker = item.get_closest_marker("weightsync_property")
        prop = str(marker.args[0]) if marker is not None and marker.args else "-"
        case = topology.topology_of(item)
        params = item.callspec.params
        fmt = next((v for k, v in params.items() if k in FORMAT_PARAMS and isinstance(v, str)),
                   None)
        key = (case.id if case is not None else "-", fmt)
        entry = keys.setdefault(impl, {}).setdefault(prop, {})
        verdict, why = decided
        # a case counts once, as selected if any of its tests is
        if entry.get(key, (None,))[0] != SELECTED:
            entry[key] = (verdict, why)
    out: dict = {}
    for impl, props in keys.items():
        for prop, decided in props.items():
            chosen = [k for k, (v, _) in decided.items() if v == SELECTED]
            refused = {OUTSIDE: {}, UNCLAIMED: {}}
            for k, (v, why) in decided.items():
                if v != SELECTED:
                    refused[v][why] = refused[v].get(why, 0) + 1
            out.setdefault(impl, {})[prop] = {
                "selected": len(chosen),
                "topologies": sorted({t for t, _ in chosen if t != "-"}),
                "formats": sorted({f for _, f in chosen if f is not None}),
                "outside": refused[OUTSIDE], "unclaimed": refused[UNCLAIMED]}
    return out
