"""A plugin's ``pytest_weightsync_extra_topologies`` reaches every topology suite and the
distributed-exporter suite: a ``Case`` in both deliveries, a ``DistCase`` as given."""

from __future__ import annotations

import types

from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from suites import conftest as suites_conftest
from suites.harness.cases import CASES, DIST_CASES, Case, DistCase

EXTRA = Case(MoESpec(num_layers=2, num_experts=6, hidden=5, intermediate=4),
             TrainerTopology(tp=1, ep=2, etp=2), ReceiverTopology(tp=2, moe_ep=2))
GIVEN = DistCase(Case(MoESpec(num_layers=1, num_experts=4, hidden=4, intermediate=2),
                      TrainerTopology(tp=2, ep=2), ReceiverTopology(tp=1)), "distributed", 64)


class _Metafunc:
    """What ``suites/conftest.py``'s ``pytest_generate_tests`` reads of a metafunc."""

    def __init__(self, fixture, hook_results):
        self.fixturenames = [fixture]
        hook = types.SimpleNamespace(pytest_weightsync_extra_topologies=lambda config: hook_results)
        self.config = types.SimpleNamespace(hook=hook)
        self.ids = None

    def parametrize(self, name, params):
        self.ids = [p.id for p in params]


def test_extra_topologies_reach_the_distributed_suite_and_the_topology_suites():
    dist = _Metafunc("dcase", [[EXTRA], [GIVEN]])
    suites_conftest.pytest_generate_tests(dist)
    assert dist.ids[:len(DIST_CASES)] == [c.id for c in DIST_CASES]
    added = dist.ids[len(DIST_CASES):]
    assert [i.rsplit("-b", 1)[0] for i in added] == [f"{EXTRA.id}-colocated",
                                                     f"{EXTRA.id}-distributed", f"{GIVEN.case.id}-distributed"]
    assert added[-1] == f"{GIVEN.case.id}-distributed-b64"

    topo = _Metafunc("moe_case", [[EXTRA], [GIVEN]])
    suites_conftest.pytest_generate_tests(topo)
    assert topo.ids[len(CASES):] == [EXTRA.id, GIVEN.case.id]
