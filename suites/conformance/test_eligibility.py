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
