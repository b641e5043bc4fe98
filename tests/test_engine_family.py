"""Engine rows say which engine family and release they are (``engine`` in the JSON report).

An implementation that is an engine's own loader (the stock SGLang rows, an engine speaking
SGLang's or vLLM's update API) sets ``engine = {"family": ..., "version": ...}``; the report
shows it per implementation, and ``None`` for a loader of no particular engine or an
attribute it cannot read.
"""

from __future__ import annotations

import json

import pytest
from toy_sources import LOADER_BASE

CONFTEST = LOADER_BASE + '''

class Engine(_Loader):
    name = "engine-row"
    engine = {"family": "tokenspeed", "version": 3}


class Plain(_Loader):
    name = "plain-row"


class Broken(_Loader):
    name = "broken-row"

    @property
    def engine(self):
        raise RuntimeError("no engine here")


@pytest.fixture
def weightsync_implementations():
    return [Engine, Plain, Broken]
'''

TESTS = '''
import pytest


@pytest.mark.weightsync_property("bit_exact")
def test_bit_exact(weightsync_loader):
    pass
'''


@pytest.mark.parametrize("xdist", [False, True], ids=["in-process", "xdist"])
def test_the_report_shows_each_implementations_engine(pytester: pytest.Pytester, xdist):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_conformance_toy=TESTS)
    args = ("-p", "weightsync", "--weightsync-report", "r.json", "--weightsync-allow-partial")
    result = (pytester.runpytest_subprocess(*args, "-n", "2") if xdist
              else pytester.runpytest(*args))
    assert result.ret == 0, result.stdout.str()
    impls = {i["name"]: i for i in json.loads((pytester.path / "r.json").read_text())
             ["implementations"]}
    assert impls["engine-row"]["engine"] == {"family": "tokenspeed", "version": "3"}
    assert impls["plain-row"]["engine"] is None
    assert impls["broken-row"]["engine"] is None


def test_the_stock_sglang_rows_say_they_are_sglang():
    pytest.importorskip("sglang")
    from importlib.metadata import version

    from pytest_weightsync.reference_impl.backends import sglang_models

    for row in (sglang_models.Qwen3MoeLoader, sglang_models.Qwen35MoeLoader):
        assert row.engine == {"family": "sglang", "version": version("sglang")}
