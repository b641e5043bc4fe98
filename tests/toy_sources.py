"""Source text of implementations the plugin's tests write into inner pytest sessions.

``TINY_LOADER`` is a correct loader (the reference's) that claims compat on one-expert
topologies (and one case of each property every loader has), so a whole conformance run
against it takes seconds; a test module writes it
after its own imports and subclasses it with the misbehaviour it studies.

``LOADER_BASE`` is a loader that claims compat and writes nothing (subclasses give it a
name); ``TOY_CASES`` (after a ``Toy`` class) registers ``Toy`` and parametrizes ``case`` over
two stand-in topologies that look like ``suites.harness.cases.Case`` to the report.
"""

LOADER_BASE = '''
import pytest
from pytest_weightsync.protocols import Capabilities


class _Loader:
    capabilities = Capabilities(formats={"compat"})

    def load_weights(self, params, payload, *, format, spec, topology, rank):
        pass
'''

TOY_CASES = '''
class ToyCase:
    """Looks like suites.harness.cases.Case to the report: spec, receiver and an id."""

    def __init__(self, id):
        self.id, self.spec, self.receiver = id, None, None


@pytest.fixture
def weightsync_implementations():
    return [Toy]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", [ToyCase("topoA"), ToyCase("topoB")], ids=["topoA", "topoB"])
'''

TINY_LOADER = '''
import functools

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


@functools.lru_cache(maxsize=None)
def _runs_everywhere():
    """(spec, receiver) of the cases the lifecycle properties every loader has get beside the
    one-expert matrix cases: the first lifecycle and replica engines of the suites. (The speed
    column's profiled topology is left out: its profile costs seconds; on CPU the verdict
    names speed as not run here, its other cases being GPU cases.)"""
    from suites.harness import cases

    return tuple((c.spec, c.receiver) for c in (cases.LIFECYCLE_CASES[0],
                                                 cases.REPLICA_CASES[0]))


def one_expert(spec, receiver):
    return spec.num_experts == 1 or (spec, receiver) in _runs_everywhere()


class Tiny:
    """A correct loader (the reference's), claiming compat on one-expert topologies and on one
    case of each lifecycle property every loader has (identity, coverage_by_rank): a full
    conformance run against it takes seconds."""

    name = "tiny"
    capabilities = Capabilities(formats={"compat"}, topology=one_expert)

    def __init__(self):
        self._impl = ReferenceImplementation()

    def begin_update(self, params, **kw):
        self._impl.begin_update(params, **kw)

    def end_update(self, params, **kw):
        self._impl.end_update(params, **kw)

    def load_weights(self, params, payload, **kw):
        self._impl.load_weights(params, payload, **kw)
'''
