"""Every refit-under-load bug the serving suite exists for, planted and killed by name.

Each mutant is the reference serving engine (or refit sequence, or run-time eligibility) with
one public bug planted; the conformance test of the property it breaks must fail on it, naming
the pattern. The reference itself passes the same tests (``suites/conformance/test_serving.py``).
"""

from __future__ import annotations

import pytest

from pytest_weightsync.capabilities import Capabilities
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.serving.engine import FlushRefused, ServingEngine
from pytest_weightsync.reference_impl.serving.orchestrator import refit

from ..conformance import test_eligibility as eligibility_suite
from ..conformance import test_serving as suite
from ..harness import serving

pytestmark = pytest.mark.weightsync_property("mutation_detected")


class StalePrefixReuse(ServingEngine):
    """lmdeploy#4917: an update leaves the prefix cache, and a reuse is reported as computed
    by the new weights."""

    def flush_cache(self) -> bool:
        return True

    def _prefill(self, request):
        super()._prefill(request)
        request.prompt_versions = [self.label] * len(request.prompt)


class RecomputeNoop(ServingEngine):
    """NeMo-RL#3839: a retract that keeps the requests' KV (the recompute never happens)."""

    def _retract(self, request):
        kept = request.cache
        super()._retract(request)
        request.kept = kept

    def _prefill(self, request):
        kept = getattr(request, "kept", None)
        if kept is None:
            return super()._prefill(request)
        request.cache, request.kept, request.status = kept, None, "running"
        self._decode(request)  # resumes on the KV of the old weights


class FlushKillsEngine(ServingEngine):
    """sglang#33784: the flush needs a fully idle scheduler (an empty waiting queue, which a
    retract just filled), and the update's refused flush kills the scheduler."""

    dead = False

    def _flush_problem(self):
        return "not fully idle" if self.waiting or self.running else super()._flush_problem()

    def update_weights(self, buckets, **kwargs):
        try:
            super().update_weights(buckets, **kwargs)
        except FlushRefused:
            self.dead = True
            raise

    def step(self):
        if self.dead:
            raise RuntimeError("scheduler died: assert flush_cache_success")
        return super().step()


class PublishAborts(ServingEngine):
    """miles#2296: publishing a label ends every in-flight request, asked or not."""

    def update_weight_version(self, new_version, abort_all_requests=None):
        super().update_weight_version(new_version, abort_all_requests=True)


class LabelBeforeComplete(ServingEngine):
    """The new label published when the update opens."""

    def _label_while_open(self, weight_version):
        return weight_version


class LabelAtAdmission(ServingEngine):
    """sglang#34185: a request's label captured when it was admitted."""

    def _token_label(self, request):
        if not hasattr(request, "admitted_label"):
            request.admitted_label = self.label
        return request.admitted_label


class OldLabelAfterUpdate(ServingEngine):
    """Tokens after an update tagged with the old version (the label not moved)."""

    def _publish_after_update(self, weight_version):
        if self.label is None:
            self.label = weight_version


class KeptRelabelled(ServingEngine):
    """Kept (in-place) requests' earlier tokens reported as the new version on resume."""

    def continue_generation(self):
        super().continue_generation()
        for request in self.running:
            request.token_versions = [self.label] * len(request.token_versions)

    resume_generation = continue_generation


class OldWeightsAfterUpdate(ServingEngine):
    """Tokens and log-probs computed from the weights held before the update (a stale copy)."""

    def _weights(self):
        if not hasattr(self, "_first_view"):
            self._first_view = self._view
        return self._first_view


def _impl(engine_class, name):
    class Mutant(ReferenceImplementation):
        capabilities = Capabilities(serving=("sglang", "vllm"))

        def open_serving_engine(self, *, spec, version, dialect, seed=0):
            return engine_class(spec, version=version, dialect=dialect, seed=seed)

    Mutant.name = name
    return Mutant()


ENGINE_MUTANTS = [
    pytest.param(StalePrefixReuse, suite.test_no_stale_kv_after_an_update,
                 dict(dialect="sglang", flush=True), "stale prefix reuse", id="stale-prefix"),
    pytest.param(RecomputeNoop, suite.test_requests_in_flight_end_as_the_pause_mode_says,
                 dict(dialect="sglang", mode="retract"), "recompute-KV no-op",
                 id="recompute-noop"),
    pytest.param(FlushKillsEngine, suite.test_flushing_after_a_pause_never_kills_the_engine,
                 dict(dialect="sglang", mode="retract"), "scheduler died", id="flush-kills"),
    pytest.param(PublishAborts, suite.test_publishing_a_label_ends_no_request_unless_asked,
                 dict(dialect="sglang", abort=False), "publishing a label ended an in-flight",
                 id="publish-aborts"),
    pytest.param(LabelBeforeComplete, suite.test_every_token_carries_the_version_that_computed_it,
                 dict(dialect="sglang"), "a label published before its update completed",
                 id="label-before-complete"),
    pytest.param(LabelAtAdmission, suite.test_every_token_carries_the_version_that_computed_it,
                 dict(dialect="vllm"), "a label captured at admission", id="label-at-admission"),
    pytest.param(OldLabelAfterUpdate, suite.test_every_token_carries_the_version_that_computed_it,
                 dict(dialect="sglang"), "weight_version is 1 after the update",
                 id="old-label-after-update"),
    pytest.param(KeptRelabelled, suite.test_requests_in_flight_end_as_the_pause_mode_says,
                 dict(dialect="sglang", mode="in_place"), "labelled version 2, it was computed "
                 "by version 1", id="keep-relabelled"),
    pytest.param(OldWeightsAfterUpdate, suite.test_no_stale_kv_after_an_update,
                 dict(dialect="vllm", flush=True), "old weights after the update",
                 id="old-weights-logprobs"),
]


@pytest.mark.parametrize("engine_class, test, kwargs, pattern", ENGINE_MUTANTS)
def test_every_serving_mutant_is_killed_by_name(engine_class, test, kwargs, pattern):
    impl = _impl(engine_class, f"mutant-{engine_class.__name__}")
    with pytest.raises(Exception) as caught:
        test(impl, **kwargs)
    assert pattern in str(caught.value), str(caught.value)
    test(ReferenceImplementation(), **kwargs)  # the reference passes the same test


class AbortingPublish(ReferenceImplementation):
    """miles#2296: the label published on its own, with update_weight_version's default."""

    name = "mutant-orchestrator-publish-aborts"

    def refit_engine(self, engine, buckets, *, version):
        engine.pause_generation("retract" if engine.dialect == "sglang" else "keep")
        engine.update_weights(buckets, flush_cache=engine.dialect == "sglang")
        engine.update_weight_version(version)
        engine.continue_generation()


class PublishFirst(ReferenceImplementation):
    """The label published before the update, which then lands unlabelled."""

    name = "mutant-orchestrator-publish-first"

    def refit_engine(self, engine, buckets, *, version):
        engine.update_weight_version(version, abort_all_requests=False)
        refit(engine, buckets, version=None)


@pytest.mark.parametrize("orchestrator, pattern", [
    (AbortingPublish(), "was aborted"), (PublishFirst(), "the engine's label is None")])
def test_every_orchestrator_mutant_is_killed_by_name(orchestrator, pattern):
    with pytest.raises(serving.ServingConformanceError, match=pattern):
        suite.test_an_orchestrators_refit_keeps_every_request_right(orchestrator, "sglang")
    suite.test_an_orchestrators_refit_keeps_every_request_right(ReferenceImplementation(),
                                                                "sglang")


def test_an_eligibility_that_ignores_token_versions_is_killed(monkeypatch):
    """Saying yes for a mixed-version rollout (the config and the log-probs alone)."""
    from pytest_weightsync.eligibility import load_eligibility_function
    from pytest_weightsync.reference_impl.rl import runtime_eligibility

    real = runtime_eligibility.runtime_decision

    def blind(config_eligible, rollouts, step_version, **kwargs):
        rollouts = [runtime_eligibility.Rollout(r.rid, [step_version] * len(r.token_versions))
                    for r in rollouts]
        return real(config_eligible, rollouts, step_version)

    impl = load_eligibility_function(
        "pytest_weightsync.reference_impl.rl.inline_logprob:inline_logprob_eligibility")
    monkeypatch.setattr(runtime_eligibility, "runtime_decision", blind)
    with pytest.raises(AssertionError):
        eligibility_suite.test_an_async_loop_is_not_eligible_and_the_tokens_are_located(impl)
    monkeypatch.setattr(runtime_eligibility, "runtime_decision", real)
    eligibility_suite.test_an_async_loop_is_not_eligible_and_the_tokens_are_located(impl)
