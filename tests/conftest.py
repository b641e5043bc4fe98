"""Fixtures shared by the plugin self-tests.

Runs started through ``pytester`` get no optional built-in implementations (the stock SGLang
rows): probing SGLang imports it (seconds per run), and an in-process run would import it
again after pytester restores ``sys.modules``. A test that wants those rows deletes
``WEIGHTSYNC_OPTIONAL_BUILTINS`` with ``monkeypatch`` (the outer session is unaffected: its
registry is built at collection, before any test runs).
"""

from __future__ import annotations

import pytest

from pytest_weightsync.registry import OPTIONAL_BUILTINS_ENV


@pytest.fixture(autouse=True)
def _no_optional_builtins_in_pytester(request: pytest.FixtureRequest,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if "pytester" in request.fixturenames:
        monkeypatch.setenv(OPTIONAL_BUILTINS_ENV, "none")
