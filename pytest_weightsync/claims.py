"""Probe every implementation's capability predicates once, at collection time.

A ``Capabilities.topology`` / ``trainer_topology`` predicate that raises would otherwise show
up as one failure per (property, topology) pair - hundreds of them, all with the same cause.
While a test function is parametrized (after the registry and the suites' ``moe_case`` have
added their parameters) this sub-plugin asks every predicate about every topology the test
will hand it, and turns the first one that raises into a collection error - one usage error
naming the implementation, the predicate and the topology - so no test runs (also under
xdist, where collection errors are reported like any other). Nothing here imports torch: the
cases are already built objects.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.protocols import ClaimError
from pytest_weightsync.registry import IMPL_FIXTURES, Registered

#: Parameters of conformance tests that carry a topology case (``spec``, ``trainer``,
#: ``receiver`` attributes, or a ``case`` holding them).
CASE_PARAMS = ("moe_case", "case", "dcase")


class CapabilityPredicateError(pytest.UsageError):
    """An implementation's capability predicate raised; the message names it."""


def _probe(entry: Registered, role: str, case) -> None:
    caps = entry.obj.capabilities
    spec, receiver = case.spec, getattr(case, "receiver", None)
    trainer = getattr(case, "trainer", None)
    if receiver is not None:
        caps.topology_refusal(role, spec, receiver)
    if trainer is not None and role != "loader":
        caps.trainer_refusal(spec, trainer)


def probe_callspecs(callspecs, seen: set) -> None:
    """Raise :class:`CapabilityPredicateError` for the first predicate that raises on an
    (implementation, case) pair of ``callspecs``; ``seen`` holds the pairs already asked."""
    for callspec in callspecs:
        params = callspec.params
        entries = [(IMPL_FIXTURES[name] or "loader", params[name]) for name in IMPL_FIXTURES
                   if isinstance(params.get(name), Registered)]
        cases = [getattr(params[name], "case", params[name]) for name in CASE_PARAMS
                 if name in params]
        cases = [case for case in cases if hasattr(case, "spec")]
        for role, entry in entries:
            for case in cases:
                key = (entry.name, role, id(case))
                if key in seen:
                    continue
                seen.add(key)
                try:
                    _probe(entry, role, case)
                except ClaimError as error:
                    raise CapabilityPredicateError(
                        f"implementation {entry.name!r} ({entry.source}): {error}") from None


_SEEN = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not any(name in metafunc.fixturenames for name in IMPL_FIXTURES):
        return
    seen = metafunc.config.stash.setdefault(_SEEN, set())
    probe_callspecs(getattr(metafunc, "_calls", ()), seen)
