"""A transport added by a third party, through the entry point only, is decoded by every suite.

The toy transport (:mod:`.toy_wire`, ``hex_lines``: one text line per tensor) is installed the
way a package installs it - a ``*.dist-info`` with an ``entry_points.txt`` under
``weightsync.transports`` on the path of a fresh pytest process - and nothing of the harness
or the reference names it. In that process the reference's exporters, their pairs re-encoded
by the toy transport, pass the expert-only and the whole-model suites, single-process and
distributed (the rank processes find the entry point too); a sender bug on that wire (one
flipped bit) is located; a transport that does not load, or is named unlike its entry point,
is refused by the registry before any test runs.

The inner session runs without the optional stock SGLang rows (``WEIGHTSYNC_OPTIONAL_BUILTINS``
empty, as every inner session of ``tests/`` runs): after decoding, every transport hands the
same pairs on, and the stock rows' judging of those pairs runs in the outer session
(``test_transports_every_suite.py`` and the conformance suites); probing SGLang and building
its rows would be a third of the inner session's time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pytest_weightsync import transports
from pytest_weightsync.registry import OPTIONAL_BUILTINS_ENV

pytestmark = pytest.mark.weightsync_property("mutation_detected")

HERE = Path(__file__).parent

INNER = '''
import pytest

from pytest_weightsync import transports
from pytest_weightsync.suites.harness import distributed as dh
from pytest_weightsync.suites.harness import model_distributed as md
from pytest_weightsync.suites.selftest import test_transports_every_suite as every
from pytest_weightsync.suites.selftest import test_wire_distributed as wired


def test_the_entry_point_is_registered():
    assert "hex_lines" in transports.names()
    assert transports.get("hex_lines").docs.endswith("toy_wire.py")


@pytest.mark.parametrize("fmt", ["compat", "direct"])
def test_the_single_process_suites_decode_it(fmt):
    every.passes_single_process_suites("hex_lines", fmt)


def test_a_flipped_bit_on_the_toy_wire_is_located(monkeypatch):
    monkeypatch.setenv("TOY_WIRE_FLIP", "1")
    with pytest.raises(AssertionError, match=r"(?s)bit.*differ|differ.*bit|mismatch"):
        every.passes_single_process_suites("hex_lines", "compat")


def test_the_expert_distributed_suite_decodes_it(rank_pool):
    dh.require_megatron()
    result = dh.run_and_judge(rank_pool, wired.OnTheWire(("hex_lines",)), wired.COLOCATED,
                              ("compat",))
    assert result.transports == {"hex_lines"}


@pytest.mark.parametrize("index", [0, 1])
def test_the_whole_model_distributed_suite_decodes_it(rank_pool, index):
    dh.require_megatron()
    impl = every.OnEveryWire()
    impl.rotation = ("hex_lines",)
    result = md.run(rank_pool, impl, every.DIST_MIXED[index], ["compat"])
    for update in range(len(result.updates)):
        assert md.judge_update(result, update)
'''


def _install(site: Path, value: str = "toy_wire:TRANSPORT", name: str = "hex_lines") -> None:
    """The toy transport as an installed distribution in ``site`` (its module and metadata)."""
    site.mkdir(exist_ok=True)
    shutil.copy(HERE / "toy_wire.py", site / "toy_wire.py")
    meta = site / "toy_wire-1.0.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-wire\nVersion: 1.0\n")
    (meta / "entry_points.txt").write_text(f"[weightsync.transports]\n{name} = {value}\n")


def test_a_transport_from_the_entry_point_is_decoded_by_every_suite(pytester):
    site = pytester.path / "site"
    _install(site)
    pytester.makepyfile(test_toy_transport=INNER)
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    pytester._monkeypatch.setenv("PYTHONPATH", pythonpath)
    pytester._monkeypatch.setenv(OPTIONAL_BUILTINS_ENV, "none")
    result = pytester.runpytest_subprocess(
        "-p", "weightsync", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "-W", "ignore::UserWarning", "--weightsync-threads", "1",
        str(pytester.path / "test_toy_transport.py"), timeout=600)
    result.assert_outcomes(passed=7)


@pytest.mark.parametrize("value, name, message", [
    ("toy_wire:NOTHING", "hex_lines", "cannot load"),
    ("toy_wire:TRANSPORT", "other_name", "named 'hex_lines', the entry point 'other_name'"),
    ("toy_wire:HexBucket", "hex_lines", "lacks recognises, encode, decode"),
    ("toy_wire:TRANSPORT", "serialized", "the name 'serialized' is taken"),
])
def test_a_broken_entry_point_is_refused_by_name(tmp_path, monkeypatch, value, name, message):
    _install(tmp_path, value, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    transports.reload()
    try:
        with pytest.raises(transports.TransportRegistryError, match=message):
            transports.names()
    finally:
        monkeypatch.undo()
        transports.reload()
    assert "hex_lines" not in transports.names()


def test_an_unknown_transport_name_lists_the_registered_ones():
    with pytest.raises(transports.TransportRegistryError, match="registered: flattened_bucket"):
        transports.get("carrier_pigeon")


def test_the_harness_names_no_transport_it_does_not_own():
    """The seam holds: outside ``pytest_weightsync/transports/`` the harness's decoding path
    (``distributed.py``, ``wire.py``) compares no transport name but the fallback's."""
    root = HERE.parents[1] / "pytest_weightsync"
    for module in ("distributed.py", "wire.py"):
        text = (root / module).read_text()
        for name in ("flattened_bucket", "serialized", "weight_transfer"):
            assert f'== "{name}"' not in text and f"== '{name}'" not in text, (module, name)
