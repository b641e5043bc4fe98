"""Fixtures shared by the plugin self-tests.

Runs started through ``pytester`` get no optional built-in implementations (the stock SGLang
rows): probing SGLang imports it (seconds per run), and an in-process run would import it
again after pytester restores ``sys.modules``. A test that wants those rows deletes
``WEIGHTSYNC_OPTIONAL_BUILTINS`` with ``monkeypatch`` (the outer session is unaffected: its
registry is built at collection, before any test runs).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from pytest_weightsync import activation
from pytest_weightsync.registry import OPTIONAL_BUILTINS_ENV


#: A test whose inner sessions must NOT ask for the plugin (a foreign project's session).
NOT_ASKED = "weightsync_not_asked"


@pytest.fixture(autouse=True)
def _no_optional_builtins_in_pytester(request: pytest.FixtureRequest,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions are weightsync sessions (``-p weightsync``, through ``PYTEST_ADDOPTS``:
    the plugin is inert unless asked for), without the optional built-in rows."""
    if "pytester" in request.fixturenames:
        monkeypatch.setenv(OPTIONAL_BUILTINS_ENV, "none")
        if request.node.get_closest_marker(NOT_ASKED) is None:
            monkeypatch.setenv("PYTEST_ADDOPTS", " ".join(
                filter(None, [os.environ.get("PYTEST_ADDOPTS", ""), "-p weightsync"])))


#: Marks a test whose inner sessions must start in a cold interpreter (one that checks what
#: a session imports: the zygote has torch imported already).
COLD = "cold_interpreter"


def pytest_configure(config: pytest.Config) -> None:
    activation.activate(config, owner=os.path.dirname(os.path.abspath(__file__)))
    config.addinivalue_line("markers", f"{COLD}: inner pytest sessions of this test start cold "
                                       f"(not forked from the warm zygote)")
    config.addinivalue_line("markers", f"{NOT_ASKED}: inner pytest sessions of this test do not "
                                       f"name the plugin (a foreign project's session)")


@pytest.fixture(autouse=True)
def _inner_sessions_fork_from_the_zygote(request: pytest.FixtureRequest,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``pytester.runpytest_subprocess`` as pytester does it (a numbered ``--basetemp``, the
    test directory on ``PYTHONPATH``, the same arguments), forked from the warm zygote."""
    if "pytester" not in request.fixturenames or request.node.get_closest_marker(COLD):
        return
    zygote = request.getfixturevalue("zygote")
    if zygote is None:
        return
    pytester = request.getfixturevalue("pytester")

    def runpytest_subprocess(*args, timeout=None):
        from _pytest.pathlib import make_numbered_dir
        from _pytest.pytester import RunResult

        basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
        argv = [f"--basetemp={basetemp}", *map(str, args)]
        for plugin in pytester.plugins:
            argv = ["-p", plugin, *argv]
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                          env.get("PYTHONPATH", "")]))
        started = time.monotonic()
        try:
            proc = zygote.run(argv, cwd=os.getcwd(), env=env, timeout=timeout or 3600)
        except subprocess.TimeoutExpired:
            raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: {argv}")
        return RunResult(proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines(),
                         time.monotonic() - started)

    monkeypatch.setattr(pytester, "runpytest_subprocess", runpytest_subprocess)


class ShippedSuites:
    """A copy of the shipped suites (conformance modules and harness, no self-tests) in a
    fresh directory, run in ``pytest -p weightsync`` subprocesses there, with that directory on
    ``PYTHONPATH`` (for test-local implementation modules) and no optional built-in rows."""

    def __init__(self, path, zygote=None):
        import shutil
        from pathlib import Path

        repo = Path(__file__).resolve().parents[1]
        self.path = path
        self.zygote = zygote
        shutil.copytree(repo / "suites", path / "suites",
                        ignore=shutil.ignore_patterns("selftest", "__pycache__"))

    def env(self, **extra) -> dict:
        import os

        env = dict(os.environ, WEIGHTSYNC_OPTIONAL_BUILTINS="none",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(self.path),
                                                            os.environ.get("PYTHONPATH")])))
        env.pop("PYTEST_XDIST_WORKER", None)
        env.update(extra)
        return env

    def command(self, *args: str) -> list:
        import sys

        return [sys.executable, "-m", "pytest", "-p", "weightsync", "-q",
                "--weightsync-report", "report.json", *args]

    def run(self, *args: str, timeout: float = 300, **env):
        """``subprocess.run`` of :meth:`command` (forked from the warm zygote when there is
        one: the same session, without paying the interpreter's start)."""
        from zygote import run_pytest

        return run_pytest(self.zygote, self.command(*args)[3:], cwd=self.path,
                          env=self.env(**env), timeout=timeout)

    def report(self) -> dict:
        import json

        return json.loads((self.path / "report.json").read_text())

    def verdicts(self) -> dict:
        return {i["name"]: i for i in self.report()["implementations"]}


@pytest.fixture(scope="session")
def zygote():
    """A warm interpreter that inner sessions fork from (``tests/zygote.py``); none with
    ``WEIGHTSYNC_TESTS_COLD=1`` (every inner session started cold, as before)."""
    if os.environ.get("WEIGHTSYNC_TESTS_COLD") == "1":
        yield None
        return
    from zygote import Zygote

    warm = Zygote()
    yield warm
    warm.close()


@pytest.fixture
def shipped(tmp_path, zygote) -> ShippedSuites:
    """The shipped suites in a fresh directory (see :class:`ShippedSuites`)."""
    return ShippedSuites(tmp_path, zygote)


def tagged_processes(tag: str) -> list:
    """Live processes (zombies are dead) whose environment carries ``WEIGHTSYNC_TEST_TAG=tag``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if (proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get("WEIGHTSYNC_TEST_TAG") == tag):
                found.append((proc.pid, proc.cmdline()))
        except (psutil.Error, OSError):
            continue
    return found


class Isolation(NamedTuple):
    tag: str
    tmpdir: Path


@pytest.fixture
def isolated(pytester, monkeypatch, tmp_path, request):
    """Tag the inner session's environment (every process it starts inherits the tag) and give
    it a private TMPDIR; afterwards no tagged process may be alive and TMPDIR must be empty -
    or, where the test module sets ``ISOLATED_TMP_JUDGES`` to a prefix, hold no entry with that
    prefix."""
    pytest.importorskip("psutil")
    tag = uuid.uuid4().hex
    tmpdir = tmp_path / "inner-tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("WEIGHTSYNC_TEST_TAG", tag)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield Isolation(tag, tmpdir)
    # multiprocessing's resource tracker leaves when the session's pipe closes: allow it a moment.
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == [], "processes outlived the pytest session"
    prefix = getattr(request.module, "ISOLATED_TMP_JUDGES", "")
    assert [d for d in os.listdir(tmpdir) if d.startswith(prefix)] == [], \
        "temporary files outlived the pytest session"
