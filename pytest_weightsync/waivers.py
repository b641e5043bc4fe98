"""Known, accepted deviations: a waiver file turns a listed test's failure into WAIVED.

A team whose engine deviates on purpose (a format it pads differently, a topology it will
never serve) still wants a green CI job that catches everything else, and a report that says
what was accepted. Like array-api-tests' xfails file, ``--weightsync-waivers FILE`` lists
tests, one pattern per line, each with the reason it is accepted::

    # the compat path of our 0.3 loader pads the last expert differently; fixed in 0.4
    conformance/test_loader.py::test_loader_lands_bit_exact[mine-*-compat]  # ENG-1234 pad

A pattern matches a node id as pytest prints it, or the id from ``conformance/`` (any
directory after the last ``suites/``) on, so one file serves a checkout and an installed
wheel. ``*`` matches any run of characters and ``?`` one; everything else is literal
(brackets included: node ids are full of them). A line without a ``#`` reason is refused
before any test runs (``pytest.UsageError``).

A listed test that fails in its call phase is reported as pytest's ``xfailed`` with the
reason, and as ``waived`` to the conformance report: its cell shows ``WAIVED``, the verdict
of an implementation whose only failures were waived is ``WAIVED``, never ``PASS``, and the
run exits 0 for it. A failure in setup or teardown is the harness's or the fixture's, and is
never waived. A waiver whose tests all passed, or that matched no test that ran, is listed as
unused under the matrix and in the JSON report, so stale waivers are seen and removed.
No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

#: The user property a waived report carries (its value: the waiver's reason).
WAIVED_PROPERTY = "weightsync_waived"
#: What pytest's terminal and junit show as the xfail reason of a waived test.
XFAIL_PREFIX = "waived: "


class WaiverFileError(pytest.UsageError):
    """The waiver file cannot be read, or one of its lines is not ``PATTERN  # reason``."""


@dataclass
class Waiver:
    pattern: str
    reason: str
    line: int
    regex: "re.Pattern" = field(repr=False, default=None)
    #: node ids the waiver matched among the tests that reported / whose failure it waived
    matched: set = field(default_factory=set)
    used: set = field(default_factory=set)

    def __post_init__(self) -> None:
        body = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch)
                       for ch in self.pattern)
        self.regex = re.compile(body + r"\Z", re.DOTALL)

    def matches(self, nodeid: str) -> bool:
        return any(self.regex.match(candidate) for candidate in candidates(nodeid))


def candidates(nodeid: str) -> tuple:
    """The ids a pattern is matched against: the node id, and its part after the last
    ``suites/`` (the same for a checkout and an installed wheel)."""
    marker = nodeid.rfind("suites/")
    if marker < 0:
        return (nodeid,)
    return (nodeid, nodeid[marker + len("suites/"):])


def parse(text: str, source: str = "<waivers>") -> list[Waiver]:
    """Every waiver of a file's ``text``; a line without a pattern and a reason is refused."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition("#")
        pattern, reason = pattern.strip(), reason.strip()
        if not sep or not reason:
            raise WaiverFileError(
                f"{source}:{number}: a waiver needs a reason: write "
                f"'PATTERN  # why this deviation is accepted', got {line!r}")
        if any(ch.isspace() for ch in pattern):
            raise WaiverFileError(
                f"{source}:{number}: a waiver's pattern is one node id pattern without spaces, "
                f"got {pattern!r}")
        out.append(Waiver(pattern, reason, number))
    return out


def load(path: str) -> list[Waiver]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise WaiverFileError(f"--weightsync-waivers: cannot read {path}: {exc}") from None
    return parse(text, path)


class Waivers:
    """The waivers of a run, and which of them were used (the pytest process and every
    xdist worker apply them; the controller keeps the record from the reports)."""

    def __init__(self, path: Optional[str], waivers: list[Waiver]) -> None:
        self.path = path
        self.waivers = waivers

    def find(self, nodeid: str) -> Optional[Waiver]:
        return next((w for w in self.waivers if w.matches(nodeid)), None)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        """Outermost, so it sees the report every other hook has finished."""
        outcome = yield
        report = outcome.get_result()
        if report.when != "call" or not report.failed:
            return
        waiver = self.find(item.nodeid)
        if waiver is None:
            return
        report.outcome = "skipped"
        report.wasxfail = XFAIL_PREFIX + waiver.reason
        report.user_properties = [*report.user_properties, (WAIVED_PROPERTY, waiver.reason)]

    def pytest_runtest_logreport(self, report) -> None:
        waiver = self.find(report.nodeid)
        if waiver is None:
            return
        waiver.matched.add(report.nodeid)
        if any(k == WAIVED_PROPERTY for k, _ in getattr(report, "user_properties", ())):
            waiver.used.add(report.nodeid)

    def unused(self) -> list[Waiver]:
        return [w for w in self.waivers if not w.used]

    def to_json(self) -> dict:
        return {"file": self.path, "waivers": [
            {"pattern": w.pattern, "reason": w.reason, "line": w.line,
             "waived": sorted(w.used), "matched": len(w.matched),
             "unused": ("matched no test that ran" if not w.matched
                        else "every matched test passed" if not w.used else None)}
            for w in self.waivers]}

    def lines(self) -> list[str]:
        """Under the matrix: what was waived, and the waivers nothing needed."""
        if not self.waivers:
            return []
        used = [w for w in self.waivers if w.used]
        out = [f"waivers ({self.path}): {sum(len(w.used) for w in used)} failure(s) waived by "
               f"{len(used)} of {len(self.waivers)} waiver(s)"]
        for w in used:
            out.append(f"  line {w.line}: {len(w.used)} waived: {w.reason}")
        for w in self.unused():
            why = "matched no test that ran" if not w.matched else "every matched test passed"
            out.append(f"  line {w.line}: unused ({why}): {w.pattern}")
        return out


_WAIVERS = pytest.StashKey[Waivers]()


def of(config: pytest.Config) -> Optional[Waivers]:
    return config.stash.get(_WAIVERS, None)


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("weightsync_waivers", None) or config.getini("weightsync_waivers")
    if not path:
        return
    if not Path(path).is_absolute():
        path = str(Path(config.invocation_params.dir) / path)
    waivers = Waivers(path, load(path))
    config.stash[_WAIVERS] = waivers
    config.pluginmanager.register(waivers, "weightsync-waivers")
