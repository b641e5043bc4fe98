"""Runs a foreign project's suite (``ci/foreign-suite/``) and records everything a pytest plugin
could change about it; compares two records.

The wheel's ``pytest11`` entry point loads pytest-weightsync into every pytest session of an
environment where it is installed - next to a team's trainer and its own tests. That team's run
must stay exactly what it was. ``ci/wheel-check.sh`` records the suite in a fresh venv before
the wheel is installed and again after, and requires:

- the same exit status and the same outcome of every test (JUnit XML);
- the same output, once pytest's own ``plugins:`` header line (it lists every installed plugin)
  and durations are set aside;
- the same side effects: the non-daemon thread a test leaves finishes its work, the atexit
  handler runs, the session's child process is alive until the project ends it, the project's
  ``gpu``-marked test runs, its signal handlers stay its own (asserted by the suite itself);
- (``imports``) with the wheel, a session that asks nothing of it imports no torch and no
  module of the plugin beyond its entry point.

And where the session names the plugin (``-p weightsync``) over the same foreign suite: the same
exit status, outcomes and side effects (its summary lines may show; it still acts only on
weightsync tests: the foreign ``gpu`` test runs, the foreign thread is waited for).

Usage: ``foreign_check.py record PYTHON OUT.json [PYTEST ARGS]``, ``foreign_check.py compare
A.json B.json [--named]``, ``foreign_check.py imports PYTHON``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "foreign-suite")
#: Files the suite's side effects write.
EFFECTS = ("atexit.txt", "child.txt", "gpu.txt", "thread.txt")
#: Where a session names the plugin, the one foreign expectation it may change: SIGINT and
#: SIGTERM get its handlers for the session (Ctrl-C or SIGTERM stops rank pools and reports
#: what ran, docs/multirank.md); SIGALRM stays the project's.
NAMED_MAY_DIFFER = {"test_foreign::test_signal_handlers_are_the_projects"}
#: Modules of the plugin a session that does not ask for it may import (its entry point).
ENTRY_MODULES = {"pytest_weightsync", "pytest_weightsync.plugin", "pytest_weightsync.activation",
                 "pytest_weightsync.hookspecs"}


def _normalized(text: str, where: str) -> list[str]:
    out = []
    for line in text.replace(where, "<dir>").splitlines():
        if line.startswith("plugins:"):
            continue  # pytest lists every installed plugin here
        line = re.sub(r"\bin [0-9.]+s\b( \([0-9:]+\))?", "in <t>", line)
        line = re.sub(r"pytest-of-[^/\s]+/pytest-[0-9]+", "<tmp>", line)
        out.append(line)
    return out


def record(python: str, *args: str) -> dict:
    where = tempfile.mkdtemp(prefix="weightsync-foreign-")
    try:
        suite, effects = os.path.join(where, "suite"), os.path.join(where, "effects")
        shutil.copytree(SUITE, suite, ignore=shutil.ignore_patterns("__pycache__"))
        os.mkdir(effects)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_", "WEIGHTSYNC_"))}
        env["FOREIGN_OUT"] = effects
        started = time.monotonic()
        proc = subprocess.run([python, "-m", "pytest", *args, "-rA", "--junitxml", "junit.xml"],
                              cwd=suite, env=env, capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - started
        outcomes = {}
        for case in ET.parse(os.path.join(suite, "junit.xml")).iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
        time.sleep(0.2)  # the atexit handler and the thread wrote before the process ended
        written = {}
        for name in EFFECTS:
            path = os.path.join(effects, name)
            written[name] = open(path).read() if os.path.exists(path) else None
        return {"exit": proc.returncode, "outcomes": outcomes, "effects": written,
                "stdout": _normalized(proc.stdout, where),
                "stderr": _normalized(proc.stderr, where), "seconds": round(seconds, 2)}
    finally:
        shutil.rmtree(where, ignore_errors=True)


def compare(without: dict, with_: dict, keys=("exit", "outcomes", "effects", "stdout",
                                             "stderr")) -> list[str]:
    problems = []
    for key in keys:
        if without[key] != with_[key]:
            a, b = without[key], with_[key]
            if isinstance(a, list):
                diff = [f"  - {x}" for x in a if x not in b] + [f"  + {x}" for x in b if x not in a]
                problems.append(f"{key} differs:\n" + "\n".join(diff[:20]))
            else:
                problems.append(f"{key} differs: without the wheel {a!r}, with it {b!r}")
    effects = without["effects"]
    wanted = {"atexit.txt": "atexit handler ran\n", "child.txt": "alive at teardown\n",
              "gpu.txt": "ran\n", "thread.txt": "flushed\n"}
    for name, text in wanted.items():
        if effects.get(name) != text:
            problems.append(f"the suite itself misbehaved without the wheel: {name} = "
                            f"{effects.get(name)!r}")
    if without["exit"] != 1:
        problems.append(f"the suite exits {without['exit']} without the wheel, expected 1 (one "
                        f"failing test)")
    return problems


def imports(python: str) -> list[str]:
    """What a session that asks nothing of the plugin imports of it (``-X importtime``)."""
    where = tempfile.mkdtemp(prefix="weightsync-foreign-")
    try:
        suite = os.path.join(where, "suite")
        shutil.copytree(SUITE, suite, ignore=shutil.ignore_patterns("__pycache__"))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_", "WEIGHTSYNC_"))}
        env["FOREIGN_OUT"] = where
        proc = subprocess.run([python, "-X", "importtime", "-m", "pytest", "--collect-only",
                               "-q"], cwd=suite, env=env, capture_output=True, text=True,
                              timeout=300)
        rows = [line.split("|") for line in proc.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2]
        names = {row[-1].strip() for row in rows}
        own_us = sum(int(row[0].split(":")[1]) for row in rows
                     if row[-1].strip().startswith("pytest_weightsync"))
        plugin = {n for n in names if n.startswith("pytest_weightsync")}
        problems = []
        if not plugin:  # (pytest imports the entry point module itself through its
            #              assertion rewriter, which -X importtime may not show)
            problems.append("the entry point was not loaded: nothing of the plugin imported")
        if plugin - ENTRY_MODULES:
            problems.append(f"imports more than the entry point: {sorted(plugin - ENTRY_MODULES)}")
        if "torch" in names:
            problems.append("imports torch")
        print(f"foreign-check: the plugin's own modules took {own_us / 1000:.1f} ms to import "
              f"({', '.join(sorted(plugin))})")
        return problems
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        with open(argv[2], "w") as f:
            json.dump(record(argv[1], *argv[3:]), f, indent=1)
        return 0
    if argv[:1] == ["compare"]:
        a, b = (json.load(open(path)) for path in argv[1:3])
        # "--named": the plugin was asked for (-p weightsync): its own summary lines may show,
        # but nothing of the foreign tests may change
        keys = ("exit", "outcomes", "effects", "stdout", "stderr")
        if argv[3:4] == ["--named"]:
            keys = ("exit", "outcomes", "effects")
            for record_ in (a, b):
                for name in NAMED_MAY_DIFFER:
                    record_["outcomes"].pop(name, None)
        problems = compare(a, b, keys)
        for line in problems:
            print(f"foreign-check: {line}", file=sys.stderr)
        if not problems:
            print(f"foreign-check: the foreign suite ran identically without and with the wheel "
                  f"({len(a['outcomes'])} tests, exit {a['exit']}; {a['seconds']} s / "
                  f"{b['seconds']} s)")
        return 1 if problems else 0
    if argv[:1] == ["imports"]:
        problems = imports(argv[1])
        for line in problems:
            print(f"foreign-check: {line}", file=sys.stderr)
        if not problems:
            print("foreign-check: a session that does not ask for the plugin imports only its "
                  "entry point, and no torch")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
