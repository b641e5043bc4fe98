"""The conformance matrix in the terminal: the table of cells and verdicts, and the lines
under it (failures with their rerun commands, waivers, the speed figures, hardening and
bucket-limit findings, what tests left behind, the counts).

A mixin of :class:`pytest_weightsync.report_collect.ConformanceReport`: it reads that
report's aggregates (``verdicts``, ``speed``, ``findings``, ``bucket_limits``,
``left_behind``, ``conformance``) and writes text only, so the terminal layout changes here
and nowhere else.
"""

from __future__ import annotations

import shlex
import sys
import textwrap
from collections import Counter

from pytest_weightsync import speed_column, waivers
from pytest_weightsync.report_results import (
    TestResult,
    _topologies,
    _topology_outcomes,
    cut,
    first_failure,
)
from pytest_weightsync.vocabulary import (
    BUCKET_LIMIT,
    BUCKET_WITHIN,
    HARDENING,
    NOT_RUN,
    OUTCOME_WAIVED,
    REPORT_PROPERTIES,
    SPEED,
    VERDICTS,
    WAIVED,
)

MAX_DETAIL = 100
#: Widest terminal line of the matrix tables (details are listed under them).
MATRIX_WIDTH = 120


class MatrixLines:
    """The terminal lines of a :class:`~pytest_weightsync.report_collect.ConformanceReport`."""

    @staticmethod
    def _bucket_cell(entries) -> str:
        """``within k/n``: of the n tests with a bucket limit, k kept the one-unit rule."""
        if not entries:
            return "-"
        within = sum(1 for e in entries if e["finding"] == BUCKET_WITHIN)
        return f"{BUCKET_WITHIN} {within}/{len(entries)}"

    @staticmethod
    def _hardening_cell(by_key: dict) -> str:
        """``refused k/n``: of the (format, kind) probes that ran, how many were refused on
        every topology."""
        if not by_key:
            return "not run"
        refused = sum(1 for texts in by_key.values()
                      if all(t.startswith("refused") and not t.startswith("refused after")
                             for t in texts))
        return f"refused {refused}/{len(by_key)}"

    def _cell_text(self, cells, impl, prop, findings, speed=None) -> str:
        c = _topology_outcomes(cells, impl, prop)
        if not c:
            return "-"
        if prop == SPEED:
            text = speed_column.cell(impl, speed if speed is not None else self.speed())
            return f"{text}, {c['failed']} failed" if c["failed"] else text
        if prop == HARDENING:
            text = self._hardening_cell(findings.get(impl, {}))
            return f"{text}, {c['failed']} failed" if c["failed"] else text
        if not c["passed"] and not c["failed"] and not c[OUTCOME_WAIVED]:
            return "not run"
        text = f"{c['passed']}/{c['failed']}/{c['skipped'] + c['not run']}"
        return f"{text} {c[OUTCOME_WAIVED]} {WAIVED}" if c[OUTCOME_WAIVED] else text

    def rerun_command(self, result: TestResult) -> str:
        """A shell command that reruns exactly ``result``'s test against its implementation,
        from the directory pytest was started in."""
        invocation = self.config.invocation_params
        path, sep, rest = result.nodeid.partition("::")
        file = result.file or str((self.config.rootpath / path).resolve())
        target = file + sep + rest
        args = ["-p", "weightsync"]
        given = list(invocation.args)
        for i, arg in enumerate(given):
            if arg == "-p" and i + 1 < len(given) and given[i + 1] != "weightsync":
                args += ["-p", given[i + 1]]
            elif arg.startswith("-p") and len(arg) > 2 and arg[2:] != "weightsync":
                args += ["-p", arg[2:]]
        for option, flag in (("weightsync_loader", "--weightsync-loader"),
                             ("weightsync_eligibility", "--weightsync-eligibility")):
            for value in self.config.getoption(option, None) or ():
                args += [flag, value]
        for option, flag in (("weightsync_call_timeout", "--weightsync-call-timeout"),
                             ("weightsync_rank_timeout", "--weightsync-rank-timeout")):
            value = self.config.getoption(option, None)
            if value is not None:
                args += [flag, str(value)]
        args += ["--weightsync-only", result.tags["implementation"], "--weightsync-allow-partial"]
        python = shlex.quote(sys.executable)
        return (f"cd {shlex.quote(str(invocation.dir))} && {python} -m pytest "
                + " ".join(shlex.quote(a) for a in [*args, target]))

    def matrix_lines(self) -> list[str]:
        cells, impls, props, topos = self._axes()
        lines = []
        if impls:
            findings = self.findings()
            lines.append("=" * 20 + " weightsync conformance matrix " + "=" * 20)
            lines += textwrap.wrap(
                f"cells: topologies passed / failed / skipped (of {len(topos)} topologies; a "
                f"topology fails when any of its tests fails; 'not run': no case ran; "
                f"'{NOT_RUN}': claimed, but no case fits the implementation's topologies). The "
                f"verdict counts every property but {' and '.join(REPORT_PROPERTIES)} "
                f"(reports), and only what ran: one of {', '.join(VERDICTS)}.", MATRIX_WIDTH)
            speed = self.speed()
            cell_text = {(impl, p): self._cell_text(cells, impl, p, findings, speed)
                         for impl in impls for p in props}
            for impl, judged in self.verdicts().items():
                for p in judged.unrun:  # claimed, no case fitted: not the "not run" of a
                    cell_text[impl, p] = NOT_RUN  # property it does not claim
            buckets = self.bucket_limits()
            columns = list(props)
            if buckets:  # a report-only column, after the properties
                columns.append(BUCKET_LIMIT)
                for impl in impls:
                    cell_text[impl, BUCKET_LIMIT] = self._bucket_cell(buckets.get(impl))
            lines += self._table_lines(impls, columns, cell_text)
            if self.interrupted:
                lines.append(f"the run was {self.interrupted}: tests without a result are not "
                             f"counted as passed")
            failures = [t for t in self.conformance() if t.outcome == "failed"]
            if failures:
                lines.append(f"failures ({len(failures)} tests; first per implementation and "
                             f"property, a located difference before a raw exception, with "
                             f"the command that reruns it):")
                by_key: dict = {}
                for t in failures:
                    by_key.setdefault((t.tags["implementation"], t.tags.get("property")),
                                      []).append(t)
                for key, tests in by_key.items():
                    t = first_failure(tests)
                    head = t.message.strip().splitlines()[0] if t.message.strip() else "(no message)"
                    lines.append(f"  {key[0]} / {key[1]} / {t.tags.get('topology', '-')}: "
                                 f"{cut(head, 300)}")
                    lines.append(f"    rerun: {self.rerun_command(t)}")
            waived = waivers.of(self.config)
            lines += waived.lines() if waived is not None else []
            lines += speed_column.lines(speed)
            lines += self.hardening_lines(findings)
            lines += self.bucket_limit_lines(buckets)
            lines += self.left_behind_lines()
        lines += self.footer_lines()
        return lines

    def left_behind_lines(self) -> list[str]:
        """Per test, what it left in the pytest process (the warnings say it too, but they
        are easy to miss below a long run)."""
        left = self.left_behind()
        if not left:
            return []
        lines = ["left behind in the pytest process (after the test; "
                 "-W error::pytest_weightsync.process_hygiene.ImplementationLeakWarning fails it):"]
        for impl in sorted(left):
            for entry in left[impl]:
                lines.append(f"  {entry['nodeid']}: {cut(entry['what'], 300)}")
        return lines

    def _table_lines(self, impls, columns, cell_text) -> list[str]:
        """The matrix in at most :data:`MATRIX_WIDTH` columns: one table when it fits, else
        the property columns in consecutive tables, the last ending with each verdict's word
        and the whole verdicts listed under it."""
        verdict = {impl: self.verdict(impl) for impl in impls}
        judged = self.verdicts()
        word = {impl: judged[impl].word if impl in judged else NOT_RUN for impl in impls}
        first = max([len("implementation")] + [len(i) for i in impls])
        widths = [max(len(p), max(len(cell_text[i, p]) for i in impls)) for p in columns]

        def table(group, last: bool, verdicts: dict) -> list[str]:
            tail = ["verdict"] if last else []
            out = ["  ".join([f"{'implementation':<{first}}"]
                             + [f"{p:>{w}}" for p, w in group] + tail).rstrip()]
            for impl in impls:
                row = [f"{impl:<{first}}"] + [f"{cell_text[impl, p]:>{w}}" for p, w in group]
                out.append("  ".join(row + ([verdicts[impl]] if last else [])).rstrip())
            return out

        pairs = list(zip(columns, widths))
        whole = first + sum(2 + w for w in widths) + 2 + max(len(v) for v in verdict.values())
        if whole <= MATRIX_WIDTH:
            return table(pairs, True, verdict)
        room = MATRIX_WIDTH - 2 - max(len("verdict"), max(len(w) for w in word.values()))
        groups, current, used = [], [], first
        for p, w in pairs:
            if current and used + 2 + w > room:
                groups.append(current)
                current, used = [], first
            current.append((p, w))
            used += 2 + w
        groups.append(current)
        lines = []
        for index, group in enumerate(groups):
            lines += table(group, index == len(groups) - 1, word)
        lines.append("verdicts:")
        for impl in impls:
            lines += textwrap.wrap(f"{impl}: {verdict[impl]}", MATRIX_WIDTH,
                                   initial_indent="  ", subsequent_indent="    ")
        return lines

    @staticmethod
    def bucket_limit_lines(buckets: dict) -> list[str]:
        """Per implementation, each test whose buckets exceed the limit by more than a unit."""
        over = {impl: [e for e in entries if e["finding"] != BUCKET_WITHIN]
                for impl, entries in buckets.items()}
        over = {impl: entries for impl, entries in over.items() if entries}
        if not over:
            return []
        lines = [f"{BUCKET_LIMIT} (a bucket may exceed bucket_bytes by one unit, the tensors "
                 f"converted from one source parameter; findings, not verdicts):"]
        for impl in sorted(over):
            for entry in over[impl]:
                lines.append(f"  {impl} / {entry['topology']}: {cut(entry['detail'], 300)}")
        return lines

    def hardening_lines(self, findings: dict) -> list[str]:
        """Per implementation, each (format, bad kind) and what the loader did with it."""
        if not findings:
            return []
        lines = [f"{HARDENING} (bad input; findings, not verdicts - only 'refused after "
                 f"writing' fails):"]
        for impl in sorted(findings):
            lines.append(f"  {impl}:")
            by_key = findings[impl]
            width = max(len(f"{f} {k}") for f, k in by_key)
            for fmt, kind in sorted(by_key):
                texts = sorted(by_key[fmt, kind].items(), key=lambda kv: -len(kv[1]["topologies"]))
                shown = "; ".join(
                    text + (f" [{_topologies(len(e['topologies']))}]" if len(texts) > 1 else "")
                    for text, e in texts)
                detail = texts[0][1]["detail"]
                if detail:
                    if len(detail) > MAX_DETAIL:
                        detail = detail[:MAX_DETAIL - 3] + "..."
                    shown += f": {detail}"
                lines.append(f"    {f'{fmt} {kind}':<{width}}  {shown}")
        return lines

    def footer_lines(self) -> list[str]:
        """Counts of everything that ran, by what it ran against: per implementation (ran /
        skipped, by role-bearing property) and the suites that test no registered
        implementation (the reference and real backends), per property."""
        lines = []
        conformance = self.conformance()
        if conformance:
            by_impl: dict[str, Counter] = {}
            for r in conformance:
                by_impl.setdefault(r.tags["implementation"], Counter())[r.outcome] += 1
            lines.append("weightsync tests per implementation (passed / failed / skipped): "
                         + ", ".join(f"{i} {c['passed']}/{c['failed']}/{c['skipped']}"
                                     + (f" ({c['not run']} without a result)" if c["not run"]
                                        else "")
                                     + (f" ({c[OUTCOME_WAIVED]} waived)" if c[OUTCOME_WAIVED]
                                        else "")
                                     for i, c in sorted(by_impl.items())))
        others = [r for r in self.results.values() if "implementation" not in r.tags]
        if others:
            by_prop: dict[str, Counter] = {}
            for r in others:
                by_prop.setdefault(r.tags.get("property", "-"), Counter())[r.outcome] += 1
            ran = {p: c for p, c in by_prop.items() if c["passed"] or c["failed"]}
            idle = sorted(p for p in by_prop if p not in ran)
            line = ("weightsync tests without an implementation under test (passed / failed / "
                    "skipped): " + ", ".join(f"{p} {c['passed']}/{c['failed']}/{c['skipped']}"
                                             for p, c in ran.items()))
            if idle:
                line += ("; " if ran else "") + "skipped entirely: " + ", ".join(
                    f"{p} ({by_prop[p]['skipped']})" for p in idle)
            lines.append(line)
        return lines
