"""Selecting conformance tests by the property they check and the payload format they send.

A property's name is not in a test's node id (``test_loader_writes_every_parameter_from_its_source``
checks ``coverage``), so ``-k coverage`` used to select nothing, and ``-k bit_exact`` also
selected ``model_bit_exact`` and ``export_bit_exact``. Here every tagged test carries its
property as a ``-k`` keyword, and ``--weightsync-property NAME`` / ``--weightsync-format
NAME`` (repeatable) select by exact name. A narrowed run is still a narrower run: the tests
left out are deselected, and the verdict says PARTIAL (``docs/validate-your-loader.md``).
No torch here.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import FORMAT_PARAMS


def property_of(item: pytest.Item):
    marker = item.get_closest_marker("weightsync_property")
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("name")
    return None if value is None else str(value)


def format_of(item: pytest.Item):
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return next((v for k, v in callspec.params.items() if k in FORMAT_PARAMS
                 and isinstance(v, str)), None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        prop = property_of(item)
        if prop is not None:
            item.extra_keyword_matches.add(prop)
    props = set(config.getoption("weightsync_property", None) or ())
    formats = set(config.getoption("weightsync_format", None) or ())
    if not props and not formats:
        return
    kept, dropped = [], []
    for item in items:
        prop, fmt = property_of(item), format_of(item)
        ok = (not props or prop in props) and (not formats or fmt is None or fmt in formats)
        (kept if ok else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
