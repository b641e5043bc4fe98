"""``--weightsync-list``: what a run would check, before anything runs.

A team that claims Qwen3-MoE whole models should learn before its first run that the claim
covers two topologies, both with one KV head - not find out from a PASS line; a loader
restricted to vLLM topologies should learn that 6 of the 30 expert topologies are its, and
that a property it has gets no case at all. With ``--weightsync-list`` the session collects
(as ``--collect-only`` does: nothing runs, no verdict, exit status 0) and prints, per selected
implementation and property, the cases (topology x payload format) its claims select
(:func:`pytest_weightsync.claimed.summarize`: its property, engine-feature, topology,
trainer, delivery and format claims asked as the suites ask them), the ones they do not, by
reason (a few reasons each, never one line per test), a property it has that no case fits
(NOT RUN, as its verdict will say), and every selected topology spelled out
(:func:`pytest_weightsync.topology.describe`). No torch here.
"""

from __future__ import annotations

import pytest

from pytest_weightsync import claimed, topology
from pytest_weightsync.vocabulary import NOT_RUN

_LISTING = pytest.StashKey[list]()
#: Refusal reasons shown per property (the rest are counted).
MAX_REASONS = 2


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("weightsync_list", False):
        config.option.collectonly = True
        if config.option.verbose <= 0:  # the listing says it better than every node id
            config.option.verbose = -2


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _reasons(refused: dict) -> str:
    """``n: reason; m: reason (+k more reasons)``, the most frequent first."""
    ranked = sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = "; ".join(f"{n}: {why if len(why) <= 120 else why[:117] + '...'}"
                      for why, n in ranked[:MAX_REASONS])
    more = len(ranked) - MAX_REASONS
    return shown + (f" (+{more} more reason{'s' if more > 1 else ''})" if more > 0 else "")


def property_line(prop: str, entry: dict) -> str:
    """One property of one implementation (an entry of :func:`claimed.summarize`)."""
    outside, unclaimed = entry["outside"], entry["unclaimed"]
    n_out, n_unc = sum(outside.values()), sum(unclaimed.values())
    if not entry["selected"]:
        if outside:
            return (f"  {prop}: {NOT_RUN} - no case fits its topologies "
                    f"({_plural(n_out, 'case', 'cases')} outside them: {_reasons(outside)})")
        return f"  {prop}: not claimed ({_reasons(unclaimed)})"
    topos = len(entry["topologies"])
    line = (f"  {prop}: {_plural(entry['selected'], 'case', 'cases')}"
            + (f" over {_plural(topos, 'topology', 'topologies')}" if topos else
               " (topology chosen at run time)")
            + (f", formats {', '.join(entry['formats'])}" if entry["formats"] else ""))
    if n_out or n_unc:
        parts = ([f"{n_out} outside its claims ({_reasons(outside)})"] if n_out else []) \
            + ([f"{n_unc} not claimed ({_reasons(unclaimed)})"] if n_unc else [])
        line += f"\n    not selected: {'; '.join(parts)}"
    return line


def listing_lines(items) -> list[str]:
    """Per implementation and property: the cases its claims select, and why the others are
    not; then every selected topology, decoded."""
    summary = claimed.summarize(items)
    topologies: dict = {}
    for item in items:
        case = topology.topology_of(item)
        if case is not None:
            topologies.setdefault(case.id, case)
    lines = ["=" * 20 + " weightsync: what this run would check " + "=" * 20]
    if not summary:
        lines.append("no conformance test of a registered implementation is selected")
    selected = set()
    for impl in sorted(summary):
        lines.append(f"{impl}:")
        for prop in sorted(summary[impl]):
            entry = summary[impl][prop]
            selected.update(entry["topologies"])
            lines.extend(property_line(prop, entry).split("\n"))
    shown = sorted(t for t in topologies if t in selected)
    if shown:
        lines.append("topologies (selected by some implementation's claims):")
        for tid in shown:
            lines.append(f"  {tid}")
            lines.append(f"    {topology.summary(topology.describe(topologies[tid]))}")
    if len(topologies) > len(shown):
        lines.append(f"({len(topologies) - len(shown)} more topologies collected, selected by "
                     f"no implementation's claims)")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.getoption("weightsync_list", False):
        session.config.stash[_LISTING] = listing_lines(session.items)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for line in config.stash.get(_LISTING, ()):
        terminalreporter.write_line(line)
