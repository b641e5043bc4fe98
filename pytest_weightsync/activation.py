"""When the plugin does anything at all, and which tests are its own.

The wheel's ``pytest11`` entry point loads :mod:`pytest_weightsync.plugin` into every pytest
session of an environment where it is installed - typically next to a team's trainer and its
own test suite. Such a session must run exactly as it would without the wheel: same outcomes,
exit status, output, signal handlers, threads and ``atexit`` handlers. So the plugin declares
its options (inert) and nothing else until a session asks for it (pytest-xdist registers its
session machinery only under ``-n``; pytest-timeout does nothing unless configured):

- the plugin is named: ``-p weightsync`` or ``-p pytest_weightsync.plugin`` (on the command
  line, in ``PYTEST_ADDOPTS`` or in the ini file's ``addopts``);
- a ``--weightsync-*`` option is given a value other than its default;
- a directory of weightsync tests is collected: its ``conftest.py`` calls :func:`activate`
  (the shipped suites do, installed or not, so ``pytest --pyargs pytest_weightsync.suites``
  works without ``-p``; under ``-n`` name the plugin, since an xdist controller collects
  nothing).

Then markers and the sub-plugins are registered (:data:`SUB_PLUGINS`)
and the machinery that acts on single tests (the ``gpu`` gate) acts only on weightsync items
(:func:`is_weightsync_item`): a test in a directory whose conftest activated the plugin, or in
the installed package, or one carrying a weightsync marker or fixture. A foreign test that
happens to share the ``gpu`` marker name keeps its own meaning, even in a weightsync session.

No torch and nothing heavy here: this module is imported by every session the wheel sees.
"""

from __future__ import annotations

import importlib
import os
from typing import Iterable

import pytest

#: Plugin names that, given to ``-p``, ask for this plugin.
PLUGIN_NAMES = ("weightsync", "pytest_weightsync.plugin")
#: Markers that make a test a weightsync item wherever it lives.
OWN_MARKERS = ("weightsync", "ranks", "weightsync_property", "weightsync_backend")
#: Fixtures the sub-plugins provide: a test using one is a weightsync item.
OWN_FIXTURES = ("rank_pool", "weightsync_impl", "weightsync_loader", "weightsync_exporter",
                "weightsync_distributed_exporter", "weightsync_serving_engine",
                "weightsync_orchestrator", "weightsync_adapter_loader",
                "weightsync_adapter_exporter", "weightsync_adapter_merger",
                "weightsync_implementations",
                "weightsync_record_property", "throughput", "eligibility_impl")

#: Sub-plugins, by module path, registered at configure time. Each is a module whose
#: top level defines pytest hooks and/or fixtures and imports no heavy dependency.
SUB_PLUGINS = (
    "pytest_weightsync.gpu_gate",
    "pytest_weightsync.deadline",
    "pytest_weightsync.boundary",
    "pytest_weightsync.ranks.dispatch",
    "pytest_weightsync.registry",
    "pytest_weightsync.cutoff",
    "pytest_weightsync.process_hygiene",
    "pytest_weightsync.session_guard",
    "pytest_weightsync.claims",
    "pytest_weightsync.report",
    "pytest_weightsync.listing",
    "pytest_weightsync.narrowing",
    "pytest_weightsync.failures",
    "pytest_weightsync.waivers",
    "pytest_weightsync.throughput",
    "pytest_weightsync.eligibility",
)

MARKERS = (
    "weightsync: a test of pytest-weightsync's machinery (the gpu gate and the session guard "
    "act on weightsync tests only: those of a directory whose conftest activates the plugin, "
    "those with a weightsync marker or fixture, and tests marked with this).",
    "gpu(n=1): the test needs CUDA with at least n visible GPUs; skipped with a reason naming "
    "what is missing otherwise. Select the CPU part with -m 'not gpu'.",
    "ranks(n, backend=None, timeout=None): run the test body in n torch.distributed ranks "
    "(gloo on CPU, NCCL on GPU by default); under torchrun, in the existing process group.",
    "weightsync_property(name): the conformance property a test checks, used as the column of "
    "the conformance matrix report.",
    "weightsync_backend(name): the optional third-party backend (megatron, sglang, "
    "megatron_bridge) a test exercises; the JSON report counts pass/skip per backend.",
)

_ACTIVE = pytest.StashKey[bool]()
_OWNED = pytest.StashKey[list]()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def named(config: pytest.Config) -> bool:
    """Whether ``-p weightsync`` (or the module's own name) was given, from any source pytest
    reads ``-p`` from (command line, ``PYTEST_ADDOPTS``, ini ``addopts``)."""
    plugins = getattr(config.known_args_namespace, "plugins", None) or ()
    return any(str(p).strip() in PLUGIN_NAMES for p in plugins)


def options_given(config: pytest.Config, defaults: dict) -> list[str]:
    """The weightsync options (``dest`` names) whose value differs from its default."""
    given = []
    for dest, default in defaults.items():
        value = getattr(config.option, dest, default)
        if value != default:
            given.append(dest)
    return given


def is_active(config: pytest.Config) -> bool:
    return config.stash.get(_ACTIVE, False)


def activate(config: pytest.Config, owner: str | os.PathLike | None = None) -> None:
    """Switch the plugin on for this session: markers and sub-plugins registered (once), and
    ``owner`` - a directory, usually the calling conftest's - recorded as holding weightsync
    items. Safe to call from a ``conftest.py``'s ``pytest_configure`` while collecting: a
    sub-plugin registered then gets its ``pytest_configure`` at once (a historic hook)."""
    if owner is not None:
        owned = config.stash.setdefault(_OWNED, [])
        path = os.path.abspath(os.fspath(owner))
        if path not in owned:
            owned.append(path)
    if config.stash.get(_ACTIVE, False):
        return
    config.stash[_ACTIVE] = True
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    for modname in SUB_PLUGINS:
        if config.pluginmanager.has_plugin(modname):
            continue
        config.pluginmanager.register(importlib.import_module(modname), modname)


def _inside(path: str, dirs: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in dirs)


def is_weightsync_item(item: pytest.Item) -> bool:
    """Whether ``item`` is one of the plugin's own tests (see the module docstring): the
    machinery that acts on single tests leaves every other test alone."""
    if any(item.get_closest_marker(name) is not None for name in OWN_MARKERS):
        return True
    path = os.path.abspath(str(getattr(item, "path", "") or ""))
    if _inside(path, [_PACKAGE_DIR, *item.config.stash.get(_OWNED, [])]):
        return True
    return any(name in OWN_FIXTURES for name in getattr(item, "fixturenames", ()))
