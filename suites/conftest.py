"""Fixtures shared by every suite (shipped conformance suites and the reference's self-tests).

``moe_case`` is parametrized over the topology matrix (``suites.harness.cases.CASES``) plus
the cases plugins add through ``pytest_weightsync_extra_topologies``: a test asks for
``moe_case`` and runs on every topology, including ones added later. ``dcase`` is the same for
distributed exporters: ``suites.harness.cases.DIST_CASES`` plus every extra topology, as
given (a ``DistCase``) or in both deliveries (a ``Case``).

Collecting the suites switches the plugin on (:func:`pytest_weightsync.activation.activate`),
so they run without ``-p weightsync`` too; a session that collects nothing of them is left
alone.
"""

from __future__ import annotations

import os

import pytest

from pytest_weightsync import activation

from .harness import cases


def pytest_configure(config: pytest.Config) -> None:
    activation.activate(config, owner=os.path.dirname(os.path.abspath(__file__)))


def _extra_cases(config) -> list:
    hook = getattr(config.hook, "pytest_weightsync_extra_topologies", None)
    if hook is None:
        return []
    extra = []
    for items in hook(config=config):
        for item in items or ():
            extra.append(item if isinstance(item, (cases.Case, cases.DistCase))
                         else cases.Case(*item))
    return extra


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "moe_case" in metafunc.fixturenames:
        extra = [c if isinstance(c, cases.Case) else c.case
                 for c in _extra_cases(metafunc.config)]
        metafunc.parametrize("moe_case", cases.case_params(extra))
    if "dcase" in metafunc.fixturenames:
        metafunc.parametrize("dcase", cases.dist_case_params(_extra_cases(metafunc.config)))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small copies are ~100x slower with more than one intra-op thread on a shared CPU."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
