"""Hooks other plugins implement, added through ``pytest_addhooks``.

A third-party package can ship a pytest plugin (entry point group ``pytest11``) that
implements these to add implementations under test or extra topologies without any
command-line option.
"""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_weightsync_register_implementations(config: pytest.Config) -> list:
    """Return implementations (loaders/exporters) the conformance suites should run against.

    Each item is an object following the protocols of ``pytest_weightsync.registry``, or a
    ``"module:attr"`` string naming one. Results of all implementations are concatenated.
    """


@pytest.hookspec
def pytest_weightsync_extra_topologies(config: pytest.Config) -> list:
    """Return extra receiver/trainer topology cases to add to every conformance matrix."""
