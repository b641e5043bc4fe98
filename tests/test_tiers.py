"""The main job runs the shipped conformance suites; the reference's self-tests run when asked.

``pytest -p weightsync suites/`` must stay minutes long on a 2-core machine, so the self-tests
under ``suites/selftest/`` are deselected unless ``--weightsync-selftests`` is given (CI) or a
self-test path is named on the command line (a developer running one file). The root
conftest's hook is driven here with the arguments a run would give it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("repo_root_conftest", ROOT / "conftest.py")
tiers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiers)


class _Config:
    def __init__(self, args, selftests=False):
        self.args = list(args)
        self.invocation_params = SimpleNamespace(dir=ROOT)
        self.stash = pytest.Stash()
        self.deselected = []
        self.hook = SimpleNamespace(pytest_deselected=lambda items: self.deselected.extend(items))
        self._selftests = selftests

    def getoption(self, name):
        assert name == "weightsync_selftests"
        return self._selftests


ITEMS = [SimpleNamespace(path=ROOT / "suites" / "conformance" / "test_loader.py"),
         SimpleNamespace(path=ROOT / "suites" / "selftest" / "test_mutations.py"),
         SimpleNamespace(path=ROOT / "tests" / "test_plugin.py")]


@pytest.mark.parametrize("args, selftests, kept", [
    (["suites/"], False, 2),
    (["suites"], True, 3),
    (["suites/selftest/test_mutations.py::test_gate_up_swap_is_located"], False, 3),
    ([os.path.join(str(ROOT), "suites", "selftest")], False, 3),
    (["tests/", "suites/conformance"], False, 2),
])
def test_self_tests_run_only_when_asked_for(args, selftests, kept):
    config, items = _Config(args, selftests), list(ITEMS)
    tiers.pytest_collection_modifyitems(config, items)
    assert len(items) == kept
    assert len(config.deselected) == len(ITEMS) - kept
    assert all("selftest" in str(i.path) for i in config.deselected)
