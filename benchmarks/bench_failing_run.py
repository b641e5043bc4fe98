"""What a failing run costs next to a passing one: the example's broken twins against the
correct classes they derive from, on the same selection.

A team runs the harness mostly while its code is wrong, so a failing run must cost what its
tests cost: not pytest formatting harness frames and tensor storages. Each pair runs the
whole shipped conformance set (``suites/`` without self-tests, no ``-x``) in a fresh pytest
process, the correct class first, then its twin:

- ``example`` loader (``loader:ExampleLoader``) vs. ``example-swapped`` (gate/up swapped);
- ``example-exporter`` (``exporter:ExampleDistributedExporter``) vs. ``example-unregrouped``
  (ETP shards of ``linear_fc1`` not regrouped).

The twins claim what their parents claim, so both runs select the same cases. Printed per
pair: wall seconds of each run (interpreter start to exit), tests passed / failed, the
failing run's time over the passing run's, and the longest failure report in lines (pytest's
FAILURES section, default ``--tb``).

Run from the repository root: ``python benchmarks/bench_failing_run.py [-n 2] [--json F]
[PATHS...]`` (PATHS: what both runs collect, default ``suites/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "weightsync-example-loader" / "src"
PACKAGE = "weightsync_example_loader"
PAIRS = (
    ("example", f"{PACKAGE}.loader:ExampleLoader",
     "example-swapped", f"{PACKAGE}.loader:SwappedGateUpLoader"),
    ("example-exporter", f"{PACKAGE}.exporter:ExampleDistributedExporter",
     "example-unregrouped", f"{PACKAGE}.exporter:UnregroupedFc1Exporter"),
)


def run(name: str, target: str, workers: int, report: Path, paths=("suites/",)) -> dict:
    env = dict(os.environ, WEIGHTSYNC_OPTIONAL_BUILTINS="none",
               PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLE),
                                                        os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "pytest", "-p", "weightsync", *paths, "-q",
               "-p", "no:cacheprovider", "--weightsync-loader", target, "--weightsync-only", name,
               "--weightsync-report", str(report)]
    if workers:
        command += ["-n", str(workers)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    data = json.loads(report.read_text())
    outcomes = [t["outcome"] for t in data["tests"] if t.get("implementation") == name]
    return {"name": name, "seconds": round(seconds, 2), "exit": done.returncode,
            "passed": outcomes.count("passed"), "failed": outcomes.count("failed"),
            "skipped": outcomes.count("skipped"),
            "verdict": next(i["verdict_word"] for i in data["implementations"]
                            if i["name"] == name),
            "longest_failure_lines": longest_failure(done.stdout)}


def longest_failure(stdout: str) -> int:
    """Lines of the longest report in pytest's FAILURES section (0 when there is none): a
    report starts at its ``___ test id ___`` line and ends at the next one or at the first
    section after it (``=== ... ===``, or the plugin's ``--- weightsync ... ---`` tables);
    its own ``--- Captured ... ---`` parts count."""
    if "= FAILURES =" not in stdout:
        return 0
    reports: list = []
    for line in stdout.split("= FAILURES =", 1)[1].splitlines()[1:]:
        if re.match(r"^_+ .* _+$", line):
            reports.append(0)
        elif re.match(r"^=+ .* =+$", line) or re.match(r"^-+ weightsync .* -+$", line):
            break  # the next section, or the plugin's tables after the failures
        elif reports:
            reports[-1] += 1
    return max(reports, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=0, help="pytest-xdist workers (default: none)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("paths", nargs="*", default=["suites/"],
                        help="what both runs of a pair collect (default: suites/)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for good, good_target, bad, bad_target in PAIRS:
            passing = run(good, good_target, args.n, Path(tmp) / f"{good}.json", args.paths)
            failing = run(bad, bad_target, args.n, Path(tmp) / f"{bad}.json", args.paths)
            rows.append({"passing": passing, "failing": failing,
                         "ratio": round(failing["seconds"] / passing["seconds"], 3)})
    print(f"{'passing run':<20} {'s':>7} {'p/f/s':>12}   {'failing run':<20} {'s':>7} "
          f"{'p/f/s':>12} {'ratio':>6} {'lines':>6}")
    for r in rows:
        p, f = r["passing"], r["failing"]
        print(f"{p['name']:<20} {p['seconds']:>7.1f} "
              f"{p['passed']:>4}/{p['failed']}/{p['skipped']:<4}   {f['name']:<20} "
              f"{f['seconds']:>7.1f} {f['passed']:>4}/{f['failed']}/{f['skipped']:<4} "
              f"{r['ratio']:>6.2f} {f['longest_failure_lines']:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
