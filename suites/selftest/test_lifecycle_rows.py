"""Rows that refuse misuse pass what they claim, and a vLLM-topology row is judged on every
lifecycle property - through the unchanged conformance tests (``lifecycle_rows.run_suite``
calls each test of ``suites/conformance/test_lifecycle.py`` with every parametrization, as
the plugin does for a registered row).

- A row restricted to vLLM engines (``lifecycle_rows.VllmRow``, the topology predicate
  ``docs/vllm.md`` prescribes) gets cases for ``identity``, ``atomic_update``, ``lifecycle``
  (the session probes and sleep), ``version`` and ``coverage_by_rank``, on every vLLM-shaped
  engine of ``cases.VLLM_LIFECYCLE_CASES`` and on nothing else, and passes them;
- rows that refuse a second ``begin_update`` while an update is open and ``load_weights``
  outside a session (``StrictSessions``, vLLM's worker; ``Staging``) pass every property they
  claim, ``atomic_update`` included, and the ``in_place`` case of ``test_loader`` (its bucket
  framed for them);
- the harness hands every call of one engine rank the same ``params`` dict and tensors.

Where each is broken the test fails: the mutants of ``test_mutations_lifecycle.py`` (a vLLM row
that publishes its version at ``begin_update``, one that loses a parameter in a level-1 sleep)
and the one here that writes beside the payload.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model.layout import fused_name

from ..conformance import test_lifecycle as suite
from ..conformance import test_loader
from ..harness import cases, lifecycle
from ..harness.judge import ConformanceError
from .lifecycle_rows import Staging, StrictSessions, VllmRow, failures, ran, run_suite, vllm_engine

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: (property, test name prefix): every lifecycle claim a vLLM row makes, the session probes and
#: sleep apart (both are property ``lifecycle``).
CLAIMED = (("identity", "test_identity"), ("atomic_update", "test_a_failed_update"),
           ("lifecycle", "test_misuse"), ("lifecycle", "test_sleep"),
           ("coverage_by_rank", "test_every_rank"), ("version", "test_the_version"))


def test_a_vllm_row_is_judged_on_every_lifecycle_property():
    results = run_suite(suite, VllmRow())
    assert not failures(results), failures(results)
    vllm_ids = {c.id for c in cases.VLLM_LIFECYCLE_CASES + cases.VLLM_UNEVEN_LIFECYCLE_CASES}
    assert len(vllm_ids) >= 2 and all(vllm_engine(c.spec, c.receiver)
                                      for c in cases.VLLM_LIFECYCLE_CASES)
    for prop, test in CLAIMED:
        judged = {case.id for case in ran(results, prop, test)}
        assert judged == vllm_ids, (prop, test, sorted(judged))
    refused = [case for rows in results.values() for _, outcome, case, _ in rows
               if outcome == "skipped" and case is not None and case.id not in vllm_ids]
    assert refused and not any(vllm_engine(c.spec, c.receiver) for c in refused)


def test_rows_that_refuse_misuse_pass_every_property_they_claim():
    strict, staging = StrictSessions(), Staging()
    for row in (strict, staging):  # they do refuse misuse
        case = cases.LIFECYCLE_CASES[0]
        engine = lifecycle.EngineRank(row, case, 0, "compat")
        with pytest.raises(RuntimeError, match="without|must be called before"):
            engine.load(engine.stream(1)[0])
        engine.begin()
        if row is strict:
            with pytest.raises(RuntimeError, match="already active"):
                engine.begin()
    results = run_suite(suite, staging)
    assert not failures(results), failures(results)
    for prop, test in CLAIMED:
        if prop != "lifecycle" or test == "test_misuse":
            assert ran(results, prop, test), (prop, test)
    # the properties where refusing misuse matters, on every engine (vLLM's ones: VllmRow)
    results = run_suite(suite, strict, only=("test_a_failed_update", "test_misuse"))
    assert not failures(results), failures(results)
    engines = {c.id for c in cases.LIFECYCLE_CASES[:2] + cases.VLLM_LIFECYCLE_CASES}
    for prop in ("atomic_update", "lifecycle"):
        assert engines <= {c.id for c in ran(results, prop)}, prop


class _WritesBesideThePayload(StrictSessions):
    """Strict sessions, but every bucket of the last layer is also written into layer 0."""

    name = "writes_beside_the_payload"

    def load_weights(self, params, payload, *, spec, **kwargs):
        super().load_weights(params, payload, spec=spec, **kwargs)
        last = spec.num_layers - 1
        if last and any(f"layers.{last}." in name for name, _ in payload):
            with torch.no_grad():
                params[fused_name(0, "w2")].copy_(params[fused_name(last, "w2")])


@pytest.mark.parametrize("fmt", ["compat", "packed"])
def test_in_place_frames_the_payload_for_loaders_with_hooks(fmt):
    """The ``in_place`` case sends its one layer inside a session: rows that refuse buckets
    outside one pass it, and a write beside the payload still fails it, located."""
    for row in (StrictSessions(), Staging(), ReferenceImplementation()):
        for case in cases.ANCHORS[:3]:
            test_loader.test_loader_writes_in_place_and_only_the_payload(row, case, fmt)
    with pytest.raises(ConformanceError, match=r"model\.layers\.0\.mlp\.experts\.w2_weight"):
        test_loader.test_loader_writes_in_place_and_only_the_payload(
            _WritesBesideThePayload(), cases.ANCHORS[0], fmt)


class _Recorder(ReferenceImplementation):
    """The reference, recording the objects every call gets."""

    name = "recorder"

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def _saw(self, params):
        self.seen.add((id(params), tuple((n, id(t)) for n, t in params.items())))

    def begin_update(self, params, **kwargs):
        self._saw(params)
        super().begin_update(params, **kwargs)

    def load_weights(self, params, payload, **kwargs):
        self._saw(params)
        super().load_weights(params, payload, **kwargs)

    def end_update(self, params, **kwargs):
        self._saw(params)
        super().end_update(params, **kwargs)

    def weight_version(self, params, **kwargs):
        self._saw(params)
        return super().weight_version(params, **kwargs)

    def sleep(self, params, **kwargs):
        self._saw(params)
        super().sleep(params, **kwargs)

    def wake_up(self, params, **kwargs):
        self._saw(params)
        super().wake_up(params, **kwargs)


@pytest.mark.parametrize("check", ["version", "sleep", "atomic"])
def test_every_call_of_an_engine_rank_gets_the_same_params_objects(check):
    """The documented promise (``docs/validate-your-loader.md``): one engine rank's calls all
    get the same ``params`` dict holding the same tensor objects."""
    row, case = _Recorder(), cases.VLLM_LIFECYCLE_CASES[0]
    run = {"version": lambda: lifecycle.check_version(row, case, "compat"),
           "sleep": lambda: lifecycle.check_sleep(row, case, "compat", 2),
           "atomic": lambda: lifecycle.check_atomic(row, case, "compat", "lost_rank")}[check]
    run()
    assert len(row.seen) == 1, len(row.seen)


def test_the_speed_column_profiles_a_vllm_row_on_a_vllm_engine():
    """The speed profile's MoE-TP x EP engine is no vLLM engine: a vLLM row is profiled on the
    same model over MoE-EP across all ranks instead, so its speed column runs too."""
    from ..conformance import test_speed

    row = VllmRow()
    stock, _ = test_speed.PROFILE_CASES[0]
    assert not vllm_engine(stock.spec, stock.receiver)
    for fmt in row.capabilities.formats:
        case, rank = test_speed._profiled(row, fmt)
        assert vllm_engine(case.spec, case.receiver) and case is not stock, (fmt, case.id)
        assert 0 <= rank < case.receiver.world_size
    reference = ReferenceImplementation()  # a row that claims the stock profile keeps it
    assert test_speed._profiled(reference, "compat")[0] is stock
