"""Fixtures shared by the plugin self-tests.

Runs started through ``pytester`` get no optional built-in implementations (the stock SGLang
rows): probing SGLang imports it (seconds per run), and an in-process run would import it
again after pytester restores ``sys.modules``. A test that wants those rows deletes
``WEIGHTSYNC_OPTIONAL_BUILTINS`` with ``monkeypatch`` (the outer session is unaffected: its
registry is built at collection, before any test runs).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from pytest_weightsync.registry import OPTIONAL_BUILTINS_ENV


@pytest.fixture(autouse=True)
def _no_optional_builtins_in_pytester(request: pytest.FixtureRequest,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if "pytester" in request.fixturenames:
        monkeypatch.setenv(OPTIONAL_BUILTINS_ENV, "none")


class ShippedSuites:
    """A copy of the shipped suites (conformance modules and harness, no self-tests) in a
    fresh directory, run in ``pytest -p weightsync`` subprocesses there, with that directory on
    ``PYTHONPATH`` (for test-local implementation modules) and no optional built-in rows."""

    def __init__(self, path):
        import shutil
        from pathlib import Path

        repo = Path(__file__).resolve().parents[1]
        self.path = path
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
        import subprocess

        return subprocess.run(self.command(*args), cwd=self.path, env=self.env(**env),
                              capture_output=True, text=True, timeout=timeout)

    def report(self) -> dict:
        import json

        return json.loads((self.path / "report.json").read_text())

    def verdicts(self) -> dict:
        return {i["name"]: i for i in self.report()["implementations"]}


@pytest.fixture
def shipped(tmp_path) -> ShippedSuites:
    """The shipped suites in a fresh directory (see :class:`ShippedSuites`)."""
    return ShippedSuites(tmp_path)


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
