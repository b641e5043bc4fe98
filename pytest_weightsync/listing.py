"""``--weightsync-list``: what a run would check, before anything runs.

A team that claims Qwen3-MoE whole models should learn before its first run that the claim
covers two topologies, both with one KV head - not find out from a PASS line. With
``--weightsync-list`` the session collects (as ``--collect-only`` does: nothing runs, no
verdict, exit status 0) and prints, per selected implementation and property, how many cases
it will run (topology x payload format), and every topology spelled out
(:func:`pytest_weightsync.topology.describe`: layers, experts, heads, KV heads, trainer
TP/EP/ETP/PP, engine TP/EP/DP, gate/up order, delivery). No torch here.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from pytest_weightsync import topology
from pytest_weightsync.registry import implementation_of
from pytest_weightsync.vocabulary import FORMAT_PARAMS

_LISTING = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("weightsync_list", False):
        config.option.collectonly = True
        if config.option.verbose <= 0:  # the listing says it better than every node id
            config.option.verbose = -2


def _property(item) -> str:
    marker = item.get_closest_marker("weightsync_property")
    return str(marker.args[0]) if marker is not None and marker.args else "-"


def listing_lines(items) -> list[str]:
    """Per implementation and property: cases (topology x format) and topologies; then every
    topology, decoded."""
    cases: dict = defaultdict(lambda: defaultdict(set))
    topologies: dict = {}
    for item in items:
        impl = implementation_of(item)
        if impl is None:
            continue
        case = topology.topology_of(item)
        callspec = getattr(item, "callspec", None)
        fmt = next((v for k, v in (callspec.params.items() if callspec else ())
                    if k in FORMAT_PARAMS and isinstance(v, str)), None)
        key = (case.id if case is not None else "-", fmt)
        cases[impl][_property(item)].add(key)
        if case is not None:
            topologies.setdefault(case.id, topology.describe(case))
    lines = ["=" * 20 + " weightsync: what this run would check " + "=" * 20]
    if not cases:
        lines.append("no conformance test of a registered implementation is selected")
    for impl in sorted(cases):
        lines.append(f"{impl}:")
        for prop in sorted(cases[impl]):
            keys = cases[impl][prop]
            topos = sorted({t for t, _ in keys if t != "-"})
            formats = sorted({f for _, f in keys if f is not None})
            lines.append(f"  {prop}: {len(keys)} case(s) over {len(topos)} topolog"
                         f"{'y' if len(topos) == 1 else 'ies'}"
                         + (f", formats {', '.join(formats)}" if formats else ""))
    if topologies:
        lines.append("topologies:")
        for tid in sorted(topologies):
            lines.append(f"  {tid}")
            lines.append(f"    {topology.summary(topologies[tid])}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.getoption("weightsync_list", False):
        session.config.stash[_LISTING] = listing_lines(session.items)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for line in config.stash.get(_LISTING, ()):
        terminalreporter.write_line(line)
