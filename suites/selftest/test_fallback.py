"""With an optional backend hidden, the plugin still loads, its tests skip with a reason that
names the package, and the reference takes the fallback path; with it present, they run.

Each hidden-backend case runs pytest in a subprocess with a plugin (``-p``) that blocks the
package before anything imports it: ``sys.modules[name] = None`` plus a ``sys.meta_path``
finder refusing the package and its submodules, which is what an environment without the
package looks like to an ``import`` statement.
"""

from __future__ import annotations

import os
import pathlib
import re
import textwrap

import pytest

from pytest_weightsync.reference_impl.backends import probe, receiver_loader, trainer_source

pytestmark = pytest.mark.weightsync_property("backend_fallback")

SUITES = pathlib.Path(__file__).resolve().parent

BLOCKER = """
import importlib.abc
import sys

HIDDEN = {hidden!r}


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden for this run)", name=name)
        return None


for _name in HIDDEN:
    sys.modules[_name] = None
sys.meta_path.insert(0, _Hide())
"""

FALLBACK_CHECK = """
from pytest_weightsync.reference_impl.backends import probe, receiver_loader, trainer_source


def test_selection_falls_back_to_reference():
    select = {{"sglang": receiver_loader, "megatron": trainer_source}}
    for name in {hidden!r}:
        status = probe(name)
        assert not status.available, status
        assert name in status.reason and "not importable" in status.reason, status.reason
        selection = select[name](status)
        assert selection.implementation == "reference", selection
        assert name in selection.reason, selection


def test_reference_receiver_path_runs_without_the_backend():
    import torch

    from pytest_weightsync.reference_impl.senders import compat
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology
    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

    spec = MoESpec(num_layers=1, num_experts=2, hidden=4, intermediate=4, dtype=torch.bfloat16)
    topo = ReceiverTopology(tp=2, moe_ep=2)
    receiver = ReferenceReceiver(spec, topo, 1)
    receiver.load(compat.export(synth.full_weights(spec, 1)))
    expected = synth.expected_receiver_params(spec, topo, 1, 1)
    for name, tensor in expected.items():
        assert torch.equal(receiver.params[name].view(torch.int16), tensor.view(torch.int16)), name
"""


def _run_hidden(pytester: pytest.Pytester, hidden: tuple[str, ...], *args: str):
    pytester.makepyfile(
        weightsync_hide_backends=BLOCKER.format(hidden=hidden),
        test_fallback_selection=FALLBACK_CHECK.format(hidden=hidden),
    )
    files = [str(pytester.path / "test_fallback_selection.py")] if hidden else []
    pythonpath = os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")]))
    pytester._monkeypatch.setenv("PYTHONPATH", pythonpath)
    return pytester.runpytest_subprocess(
        "-p", "weightsync_hide_backends", "-p", "no:cacheprovider", "-p", "no:xdist",
        "--weightsync-threads", "1", "-rs", "-q", "-W", "ignore::UserWarning",
        *files, *args,
    )


def _skip_reasons(output: str) -> list[str]:
    return re.findall(r"^SKIPPED \[\d+\] .*$", output, flags=re.M)


def test_hidden_sglang_skips_its_suite_and_falls_back_to_reference_receiver(pytester):
    result = _run_hidden(pytester, ("sglang",), str(SUITES / "test_sglang_backend.py"))
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0 and outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("passed") == 2, result.stdout.str()  # the fallback checks ran
    assert outcomes.get("skipped", 0) >= 1, result.stdout.str()
    reasons = _skip_reasons(result.stdout.str())
    assert reasons and all("sglang" in r for r in reasons), reasons


def test_hidden_megatron_skips_its_suite_and_falls_back_to_reference_shards(pytester):
    result = _run_hidden(pytester, ("megatron",), str(SUITES / "test_megatron_backend.py"))
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0 and outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("passed") == 2, result.stdout.str()
    assert outcomes.get("skipped", 0) >= 6, result.stdout.str()  # every megatron test, each with a reason
    reasons = _skip_reasons(result.stdout.str())
    assert reasons and all("megatron" in r for r in reasons), reasons


BRIDGE_PROBE_CHECK = """
from pytest_weightsync.reference_impl.backends import probe


def test_probe_reports_megatron_bridge_missing():
    status = probe("megatron_bridge")
    assert not status.available, status
    assert "megatron_bridge" in status.reason and "not importable" in status.reason, status.reason
"""


def test_hidden_megatron_bridge_skips_its_suite(pytester):
    """Only ``megatron.bridge`` hidden (megatron-core stays): the Bridge suite skips naming it."""
    pytester.makepyfile(
        weightsync_hide_backends=BLOCKER.format(hidden=("megatron.bridge",)),
        test_bridge_probe=BRIDGE_PROBE_CHECK,
    )
    pythonpath = os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")]))
    pytester._monkeypatch.setenv("PYTHONPATH", pythonpath)
    result = pytester.runpytest_subprocess(
        "-p", "weightsync_hide_backends", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", "-q",
        "-W", "ignore::UserWarning", str(pytester.path / "test_bridge_probe.py"),
        str(SUITES / "test_megatron_bridge.py"),
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0 and outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("passed") == 1, result.stdout.str()
    assert outcomes.get("skipped", 0) >= 5, result.stdout.str()
    reasons = _skip_reasons(result.stdout.str())
    assert reasons and all("megatron_bridge" in r for r in reasons), reasons


@pytest.fixture(scope="module")
def sglang_runner_modules():
    """Import SGLang's runner modules before pytester snapshots ``sys.modules``.

    The in-process run below restores ``sys.modules`` when it ends; a runner module first
    imported inside it would be dropped while its process-wide registrations stay, and the
    next layer built with that runner would fail with "already registered". A module-scoped
    fixture is set up before the function-scoped ``pytester`` takes its snapshot.
    """
    if probe("sglang").available:
        from pytest_weightsync.reference_impl.backends.sglang import preload_runner_modules

        preload_runner_modules()


def test_with_sglang_present_its_tests_run(sglang_runner_modules, pytester):
    """In-process (SGLang is already imported here, so no second 15 s import)."""
    status = probe("sglang")
    if not status.available:
        pytest.skip(status.reason)
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-W", "ignore::UserWarning",
        str(SUITES / "test_sglang_backend.py"), "-k", "placement_and_order and moetp2-moeep2",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) == 2, result.stdout.str()


def test_selection_in_this_environment_matches_probes():
    sglang, megatron = probe("sglang"), probe("megatron")
    assert receiver_loader(sglang).implementation == ("sglang" if sglang.available else "reference")
    assert trainer_source(megatron).implementation == ("megatron" if megatron.available else "reference")
    missing = probe("deep_ep")
    if not missing.available:
        assert "deep_ep" in missing.reason and "not importable" in missing.reason
    bridge = probe("megatron_bridge")
    # The probe imports the module the suites use (param_mapping), not megatron.bridge.
    assert bridge.module == "megatron.bridge.models.conversion.param_mapping"
    if not bridge.available:
        assert "megatron_bridge" in bridge.reason and "not importable" in bridge.reason


def test_unknown_backend_name_is_rejected_with_the_known_names():
    from pytest_weightsync.reference_impl.backends import UnknownBackendError

    with pytest.raises(UnknownBackendError, match="known backends: .*sglang"):
        probe("vllm")
