"""Fixtures of the reference's self-tests (not shipped with the suites).

A self-test that plants a mutant with ``monkeypatch`` (a layout function swapped, a hash
weakened) must see the mutant everywhere, and the tests after it must not: the project keeps
pure results in caches (``functools.lru_cache`` of layouts and expected states, the oracle's
block cache), which would otherwise hand a mutant the real results - the mutant survives - or
hand the next test the mutant's - a correct reference fails, depending on which tests an xdist
worker happened to run before it.
"""

from __future__ import annotations

import sys

import pytest

#: Modules whose caches the fixture clears (the project's, the suites' harness).
_OWN = ("pytest_weightsync", "suites")


def clear_project_caches() -> None:
    for module in list(sys.modules.values()):
        if not (getattr(module, "__name__", None) or "").startswith(_OWN):
            continue
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)  # lru_cache, the harness's memo
            if callable(clear) and callable(value):
                clear()
    synth = sys.modules.get("pytest_weightsync.reference_impl.oracle.synth")
    if synth is not None:
        synth.clear_block_cache()


@pytest.fixture(autouse=True)
def _no_cache_outlives_a_planted_mutant(request):
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    clear_project_caches()
    yield
    clear_project_caches()
