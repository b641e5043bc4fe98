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

    Each item is an object following the protocols of ``pytest_weightsync.protocols``, a class
    instantiated with no arguments, or a ``"module:attr"`` string naming either. The lists
    returned by every implementation of this hook are concatenated.
    """


@pytest.hookspec
def pytest_weightsync_extra_topologies(config: pytest.Config) -> list:
    """Return extra topology cases to add to every conformance matrix.

    Each item is a ``suites.harness.cases.Case``, a ``(spec, trainer, receiver)`` tuple of
    ``pytest_weightsync.reference_impl.model.layout`` objects (``MoESpec``, ``TrainerTopology``,
    ``ReceiverTopology``), or a ``suites.harness.cases.DistCase`` (a case, a delivery and a
    bucket limit). A ``Case`` reaches every topology suite and, in both deliveries, the
    distributed-exporter suite (in ``trainer.world_size`` ranks); a ``DistCase`` reaches the
    distributed-exporter suite as given, and its ``case`` every topology suite.
    """
