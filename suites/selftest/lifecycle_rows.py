"""Correct engine-side loaders that refuse misuse, and a driver that runs a row through the
whole lifecycle suite - so the self-tests can show such rows claim everything they support
and pass, and that a row restricted to vLLM topologies is judged on every property.

- :class:`StrictSessions`: the reference keeping its session as vLLM's worker does
  (``v1/worker/gpu_worker.py``; ``reference_impl/backends/vllm.py``): a second
  ``begin_update`` while an update is open, a ``load_weights`` or an ``end_update`` without
  one are refused with a ``RuntimeError``, and a bucket that raises ends the session.
- :class:`VllmRow`: :class:`StrictSessions` claiming only vLLM engines
  (``vllm_layout.vllm_topology(receiver) is not None``) and the formats vLLM's
  ``load_weights`` takes, as ``docs/validate-your-loader.md`` ("Validate your engine") tells
  a vLLM-compatible row to.
- :class:`Staging`: stages every update in a copy of the parameters and writes nothing before
  ``end_update`` (atomic by construction); refuses ``load_weights`` outside a session; a
  second ``begin_update`` restarts, dropping the stage; its version names the last complete
  update also while one is open - the parameters still hold it.
"""

from __future__ import annotations

import inspect
import itertools

import pytest

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.backends.vllm import SESSION_ERRORS
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model import vllm_layout
from pytest_weightsync.vocabulary import LIFECYCLE


class StrictSessions(ReferenceImplementation):
    """The reference with vLLM's worker session (see the module docstring)."""

    name = "strict_sessions"

    def begin_update(self, params, **kwargs):
        if self._find_open(params) is not None:
            raise RuntimeError(SESSION_ERRORS["start while an update is active"])
        super().begin_update(params, **kwargs)

    def load_weights(self, params, payload, **kwargs):
        if self._find_open(params) is None:
            raise RuntimeError(SESSION_ERRORS["update_weights without start"])
        try:
            super().load_weights(params, payload, **kwargs)
        except Exception:
            self._open.pop(id(params), None)  # a chunk that raises ends the session
            raise

    def end_update(self, params, **kwargs):
        if self._find_open(params) is None:
            raise RuntimeError(SESSION_ERRORS["finish without start"])
        super().end_update(params, **kwargs)


def vllm_engine(spec, receiver) -> bool:
    """Whether the harness's engine ``receiver`` is a vLLM engine."""
    return vllm_layout.vllm_topology(receiver) is not None


class VllmRow(StrictSessions):
    """A vLLM-compatible engine row (see the module docstring)."""

    name = "vllm_row"
    capabilities = Capabilities(formats=tuple(sorted(vllm_layout.LOADED_FORMATS)),
                                orders=("gate_up",), padded=False, topology=vllm_engine,
                                expert_placements=("even", "linear_uneven"),
                                lifecycle=LIFECYCLE)


class Staging:
    """A loader that stages each update (see the module docstring)."""

    name = "staging"
    capabilities = Capabilities(lifecycle=("sessions", "atomic", "version"))

    def __init__(self):
        self._inner = ReferenceImplementation()  # validates and lands each bucket in the stage
        self._open: dict = {}  # id(params) -> (params, the stage)
        self._completed: dict = {}  # id(params) -> (params, updates completed)

    def _stage(self, params, call: str):
        entry = self._open.get(id(params))
        if entry is None or entry[0] is not params:
            raise RuntimeError(f"{call} without begin_update: this engine loads only inside an "
                               f"update")
        return entry[1]

    def begin_update(self, params, **kwargs):
        self._open.pop(id(params), None)  # a second begin_update restarts: the stage is dropped
        stage = {name: tensor.detach().clone() for name, tensor in params.items()}
        self._inner.begin_update(stage, **kwargs)
        self._open[id(params)] = (params, stage)

    def load_weights(self, params, payload, **kwargs):
        self._inner.load_weights(self._stage(params, "load_weights"), payload, **kwargs)

    def end_update(self, params, **kwargs):
        stage = self._stage(params, "end_update")
        del self._open[id(params)]
        self._inner.end_update(stage, **kwargs)  # refuses an incomplete update: nothing written
        self.write(params, stage)
        entry = self._completed.get(id(params))
        done = entry[1] if entry is not None and entry[0] is params else 0
        self._completed[id(params)] = (params, done + 1)

    @staticmethod
    def write(params, stage) -> None:
        import torch

        with torch.no_grad():
            for name, tensor in params.items():
                tensor.copy_(stage[name])

    def weight_version(self, params, **kwargs):
        entry = self._completed.get(id(params))
        return entry[1] if entry is not None and entry[0] is params else None


# --------------------------------------------------------------------------------------------
# Running a row through the whole lifecycle suite
# --------------------------------------------------------------------------------------------


def _axes(test) -> list:
    """``[(kwargs, id), ...]`` per ``parametrize`` mark of ``test``."""
    axes = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")]
        axis = []
        for value in mark.args[1]:
            values = value.values if hasattr(value, "values") else (value,)
            ident = getattr(value, "id", None) or str(value)
            axis.append((dict(zip(names, values)), ident))
        axes.append(axis)
    return axes


def run_suite(module, impl, only=(), fixtures=None) -> dict:
    """Every test of ``module`` marked ``weightsync_property`` (whose name starts with one of
    ``only``, when given), every parametrization, with ``impl`` as the loader:
    ``{property: [(test id, outcome, case or None, detail)]}``, outcome ``passed``,
    ``skipped`` or ``failed`` (the failure's message as detail)."""
    fixtures = {"weightsync_record_property": lambda *_: None, **(fixtures or {})}
    results: dict = {}
    for name, test in sorted(vars(module).items()):
        marks = [m for m in getattr(test, "pytestmark", []) if m.name == "weightsync_property"]
        if not name.startswith("test_") or not marks:
            continue
        if only and not name.startswith(tuple(only)):
            continue
        prop = marks[0].args[0]
        taken = inspect.signature(test).parameters
        for combo in itertools.product(*_axes(test)):
            kwargs = {k: v for part, _ in combo for k, v in part.items()}
            ident = f"{name}[{'-'.join(i for _, i in combo)}]"
            kwargs.update({k: v for k, v in fixtures.items() if k in taken})
            try:
                test(impl, **{k: v for k, v in kwargs.items() if k != "weightsync_loader"})
                outcome, detail = "passed", ""
            except pytest.skip.Exception as skip:
                outcome, detail = "skipped", str(skip)
            except AssertionError as failure:
                outcome, detail = "failed", str(failure)
            results.setdefault(prop, []).append((ident, outcome, kwargs.get("case"), detail))
    return results


def failures(results: dict) -> list:
    """``(test id, message head)`` of every failed test of :func:`run_suite`'s results."""
    return [(ident, detail[:300]) for rows in results.values()
            for ident, outcome, _, detail in rows if outcome == "failed"]


def ran(results: dict, prop: str, test: str = "") -> list:
    """The cases of ``prop`` (of tests whose name starts with ``test``) that ran and passed."""
    return [case for ident, outcome, case, _ in results.get(prop, ())
            if outcome == "passed" and ident.startswith(test)]
