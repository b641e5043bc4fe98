"""Conformance of inline log-prob eligibility functions: when may ``old_log_probs =
log_probs.detach()`` replace the old-policy forward?

Every test runs against the reference and every ``--weightsync-eligibility MODULE:ATTR``
function (fixture ``eligibility_impl``), over configs parsed by replicas of the frameworks'
real argument parsers (``suites/harness/eligibility.py``), against truth tables no code under
test is consulted for: the decision table (each condition alone, then in combination), every
combination of the conditions, generated configs, and the real recipes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from ..harness.eligibility import (
    FRAMEWORKS,
    ON_POLICY_RECIPE,
    RELAX_OFF_POLICY_RECIPE,
    RELAX_ON_POLICY_RECIPE,
    SLIME_OFF_POLICY_RECIPE,
    every_combination,
    generated_case,
    generated_configs,
    recipe_case,
    table_cases,
)

pytestmark = pytest.mark.weightsync_property("inline_logprob_eligibility")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decision_table(eligibility_impl, framework):
    eligibility_impl.assert_agrees(table_cases(framework))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_combination_of_conditions(eligibility_impl, framework):
    cases = every_combination(framework)
    assert sum(c.expected for c in cases) >= 2  # the grid holds eligible configs at all
    eligibility_impl.assert_agrees(cases)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
          deadline=None, max_examples=25, derandomize=True, database=None)
@given(generated=generated_configs())
def test_generated_configs_agree_with_the_truth_tables(eligibility_impl, generated):
    framework, values = generated
    eligibility_impl.assert_agrees([generated_case(framework, values)])


@pytest.mark.parametrize(
    "framework, argv",
    [("slime", ON_POLICY_RECIPE), ("relax", ON_POLICY_RECIPE), ("relax", RELAX_ON_POLICY_RECIPE)],
    ids=["slime", "relax_default_staleness", "relax_explicit_staleness"],
)
def test_on_policy_recipe_from_the_real_parser_is_eligible(eligibility_impl, framework, argv):
    eligibility_impl.assert_agrees([recipe_case(framework, argv, True)])


@pytest.mark.parametrize(
    "framework, argv",
    [("slime", SLIME_OFF_POLICY_RECIPE), ("relax", RELAX_OFF_POLICY_RECIPE)],
    ids=["slime", "relax_fully_async"],
)
def test_off_policy_recipe_from_the_real_parser_is_not_eligible(eligibility_impl, framework, argv):
    eligibility_impl.assert_agrees([recipe_case(framework, argv, False)])


# -- the run-time half: a rollout is eligible only if every token came from the step's weights --

def _rollouts(engine, rids):
    from pytest_weightsync.reference_impl.rl.runtime_eligibility import Rollout

    return [Rollout(rid, engine.request(rid).token_versions, engine.request(rid).logprobs)
            for rid in rids]


def _trainer_logprobs(engine, rids, version):
    from pytest_weightsync.reference_impl.oracle import token_forward

    from ..harness import serving

    return {rid: [float(x) for x in token_forward.score(serving.oracle(version),
                                                        engine.request(rid).prompt,
                                                        engine.request(rid).output)]
            for rid in rids}


def test_an_on_policy_loop_is_eligible_at_run_time_token_by_token(eligibility_impl):
    """generate -> (decision) -> train step -> refit -> generate -> (decision), on the reference
    serving engine: every rollout of step ``v`` came from version ``v``, its log-probs are the
    trainer forward's bit for bit, and the config is on-policy: eligible at every step."""
    from pytest_weightsync.reference_impl.rl.runtime_eligibility import runtime_decision
    from pytest_weightsync.reference_impl.serving.engine import ServingEngine
    from pytest_weightsync.reference_impl.serving.orchestrator import refit

    from ..harness import serving
    from ..harness.eligibility import parse

    config = eligibility_impl.decide(parse("slime", ON_POLICY_RECIPE))
    assert config.eligible, config
    engine = ServingEngine(serving.spec(), version=1)
    for step_version in (1, 2):
        if step_version > 1:  # the optimizer step made version 2: refit, nothing in flight
            refit(engine, serving.update_buckets(step_version), version=step_version)
        rids = [engine.submit(list(p), serving.NEW_TOKENS) for p in serving.PROMPTS]
        serving.run_to_end(engine, rids)
        decision = runtime_decision(config.eligible, _rollouts(engine, rids), step_version,
                                    trainer_logprobs=_trainer_logprobs(engine, rids,
                                                                       step_version))
        assert decision.eligible, (step_version, [str(r) for r in decision.reasons])


def test_an_async_loop_is_not_eligible_and_the_tokens_are_located(eligibility_impl):
    """Staleness 1 with partial rollouts: requests in flight across a refit finish under the
    new weights. The config decision already refuses; the run-time decision refuses even a
    config that would allow it, naming each rollout's first token of the old version - the
    tokens the harness counted before the refit."""
    from pytest_weightsync.reference_impl.rl.runtime_eligibility import runtime_decision
    from pytest_weightsync.reference_impl.serving.engine import ServingEngine

    from ..harness import serving
    from ..harness.eligibility import parse

    config = eligibility_impl.decide(parse("relax", RELAX_OFF_POLICY_RECIPE))
    assert not config.eligible, config
    engine = ServingEngine(serving.spec(), version=1)
    rids = [engine.submit(list(p), serving.NEW_TOKENS) for p in serving.PROMPTS]
    for _ in range(3):
        engine.step()
    before = {rid: len(engine.request(rid).output) for rid in rids}
    engine.pause_generation("in_place")  # a partial rollout: kept across the refit
    engine.update_weights(serving.update_buckets(2), flush_cache=False, weight_version=2)
    engine.continue_generation()
    serving.run_to_end(engine, rids)
    for config_eligible in (config.eligible, True):
        decision = runtime_decision(config_eligible, _rollouts(engine, rids), 2,
                                    trainer_logprobs=_trainer_logprobs(engine, rids, 2))
        assert not decision.eligible
        located = {r.rid: r.index for r in decision.reasons if "version" in r.needs}
        assert located == {rid: 0 for rid in rids if before[rid]}, (located, before)
