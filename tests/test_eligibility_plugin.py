"""The ``--weightsync-eligibility`` option: third-party eligibility functions run through the
inline-logprob suite, and the suite catches the check that read a field the real config lacks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pytest_weightsync.eligibility import (
    Case,
    EligibilityImpl,
    EligibilityResultError,
    normalize_result,
    recording_namespace,
)

SUITE = Path(__file__).resolve().parents[1] / "suites" / "conformance" / "test_eligibility.py"

# The check as first written: `rl_partial_rollouts` is not a field of the frameworks'
# Namespace (their flag is --partial-rollout), so getattr's default always applies.
RELAX_BUG_MUTANT = '''
def can_inline_logprobs(args):
    if getattr(args, "rl_partial_rollouts", True):
        return False
    return (
        args.colocate
        and args.global_batch_size == args.rollout_batch_size * args.n_samples_per_prompt
        and getattr(args, "max_staleness", 0) == 0
        and args.update_weights_interval == 1
        and not args.use_rollout_logprobs
        and not (args.use_routing_replay and not args.use_rollout_routing_replay)
        and args.kl_coef == 0
    )
'''

# Written independently of the reference, in each of the three accepted return forms.
CORRECT_THIRD_PARTY = '''
from types import SimpleNamespace


def _blockers(args):
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        one_step = args.num_steps_per_rollout == 1
    else:
        one_step = args.global_batch_size == samples
    checks = {
        "colocate": args.colocate,
        "one step per rollout": one_step,
        "max_staleness": getattr(args, "max_staleness", 0) == 0,
        "update_weights_interval": args.update_weights_interval == 1,
        "partial_rollout": not args.partial_rollout,
        "use_rollout_logprobs": not args.use_rollout_logprobs,
        "routing replay recording": args.use_rollout_routing_replay or not args.use_routing_replay,
        "kl_coef": args.kl_coef == 0,
    }
    return [name for name, ok in checks.items() if not ok]


def as_bool(args):
    return not _blockers(args)


def as_pair(args):
    blockers = _blockers(args)
    return not blockers, blockers


def as_object(args):
    blockers = _blockers(args)
    return SimpleNamespace(eligible=not blockers, reasons=blockers)
'''


@pytest.fixture(scope="module", autouse=True)
def _torch_loaded_before_pytester():
    """The suites' conftest imports torch. ``pytester`` unloads every module imported while it
    is active, and a C extension cannot be imported twice in one process: load torch before
    the (function-scoped) ``pytester`` takes its snapshot."""
    pytest.importorskip("torch")


def run_suite(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.syspathinsert()
    return pytester.runpytest(str(SUITE), "-p", "no:cacheprovider", *args)


def test_the_relax_bug_mutant_fails_the_suite_naming_the_absent_field(pytester):
    pytester.makepyfile(relax_bug_mutant=RELAX_BUG_MUTANT)
    result = run_suite(
        pytester, "--weightsync-eligibility", "relax_bug_mutant:can_inline_logprobs",
        "-k", "relax_bug_mutant",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 5, outcomes
    result.stdout.fnmatch_lines([
        "*eligibility function 'relax_bug_mutant:can_inline_logprobs' disagrees with the "
        "reference on * config(s):*",
        "*case*| colocate | rollout_batch_size |*| expected | got*",
        "*it read field(s) that the config does not carry: 'rl_partial_rollouts'*",
    ])
    result.stdout.fnmatch_lines([
        "FAILED*test_on_policy_recipe_from_the_real_parser_is_eligible"
        "[[]relax_bug_mutant:can_inline_logprobs-slime[]]*",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize("form", ["as_bool", "as_pair", "as_object"])
def test_a_correct_third_party_function_passes_the_suite(pytester, form):
    pytester.makepyfile(third_party_rl=CORRECT_THIRD_PARTY)
    spec = f"third_party_rl:{form}"
    # Every test of the suite for one form; the other two through the recipes only, to stay
    # fast. The reference's own runs are covered by the suite itself.
    selection = ["-k", form] if form == "as_pair" else ["-k", f"recipe and {form}"]
    result = run_suite(pytester, "--weightsync-eligibility", spec, "-v", *selection)
    result.assert_outcomes(failed=0, errors=0, passed=result.parseoutcomes()["passed"])
    result.stdout.fnmatch_lines([
        f"*test_on_policy_recipe_from_the_real_parser_is_eligible[[]{spec}-slime[]] PASSED*",
        f"*test_off_policy_recipe_from_the_real_parser_is_not_eligible"
        f"[[]{spec}-relax_fully_async[]] PASSED*",
    ])
    if form == "as_pair":
        result.stdout.fnmatch_lines(
            [f"*test_every_combination_of_conditions[[]{spec}-relax[]] PASSED*"]
        )


def test_several_functions_run_side_by_side(pytester):
    pytester.makepyfile(third_party_rl=CORRECT_THIRD_PARTY, relax_bug_mutant=RELAX_BUG_MUTANT)
    result = run_suite(
        pytester,
        "--weightsync-eligibility", "third_party_rl:as_bool",
        "--weightsync-eligibility", "relax_bug_mutant:can_inline_logprobs",
        "-k", "test_decision_table and not rows", "-v",
    )
    result.stdout.fnmatch_lines_random([
        "*test_decision_table[[]reference-relax[]] PASSED*",
        "*test_decision_table[[]third_party_rl:as_bool-relax[]] PASSED*",
        "*test_decision_table[[]relax_bug_mutant:can_inline_logprobs-relax[]] FAILED*",
    ])


def test_an_unknown_return_form_fails_naming_the_function(pytester):
    pytester.makepyfile(vague="def decide(args):\n    return 'yes'\n")
    result = run_suite(
        pytester, "--weightsync-eligibility", "vague:decide", "-k", "recipe and vague"
    )
    result.stdout.fnmatch_lines([
        "*EligibilityResultError: eligibility function 'vague:decide' returned str 'yes'; "
        "expected a bool, a (bool, reasons) pair*",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_function_that_raises_is_reported_in_the_table(pytester):
    # Reads max_staleness directly: fine on Relax, but slime's Namespace has no such field.
    pytester.makepyfile(strict="def decide(args):\n    return args.max_staleness == 0\n")
    result = run_suite(
        pytester, "--weightsync-eligibility", "strict:decide", "-k", "on_policy_recipe and strict"
    )
    result.stdout.fnmatch_lines([
        "*| raised AttributeError: 'Namespace' object has no attribute 'max_staleness'*",
        "*it read field(s) that the config does not carry: 'max_staleness'*",
    ])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "'no_colon' is not of the form 'module:attr'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("json:no_such_attr", "module 'json' has no attribute 'no_such_attr'"),
        (
            "json:decoder.JSONDecodeError.__doc__",
            "'decoder.JSONDecodeError.__doc__' is a str, not a function",
        ),
    ],
)
def test_a_bad_spec_is_a_usage_error(pytester, spec, message):
    result = run_suite(pytester, "--weightsync-eligibility", spec, "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--weightsync-eligibility {spec!r}: {message}*"])


# -- the adapter, directly ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result, expected",
    [
        (True, (True, ())),
        ((False, ["a", "b"]), (False, ("a", "b"))),
        ((False, "one reason"), (False, ("one reason",))),
        (argparse.Namespace(eligible=True), (True, ())),
        (argparse.Namespace(eligible=False, reasons=("x",)), (False, ("x",))),
    ],
)
def test_normalize_result_accepts_the_three_forms(result, expected):
    assert normalize_result(result, "f") == expected


@pytest.mark.parametrize("result", [None, 1, "True", (1, ()), argparse.Namespace(eligible=1)])
def test_normalize_result_refuses_anything_else(result):
    with pytest.raises(EligibilityResultError, match="eligibility function 'f' returned"):
        normalize_result(result, "f")


def test_recording_namespace_records_only_absent_lookups():
    seen: list[str] = []
    ns = recording_namespace({"colocate": True}, seen)
    assert isinstance(ns, argparse.Namespace)
    assert ns.colocate is True
    assert getattr(ns, "rl_partial_rollouts", "dflt") == "dflt"
    assert not hasattr(ns, "max_staleness")
    assert vars(ns) == {"colocate": True}
    assert seen == ["rl_partial_rollouts", "max_staleness"]


def test_assert_agrees_lists_every_disagreement():
    impl = EligibilityImpl("always_true", lambda args: True)
    cases = [
        Case(f"c{i}", argparse.Namespace(colocate=bool(i % 2), rollout_batch_size=i), i % 3 == 0)
        for i in range(6)
    ]
    with pytest.raises(pytest.fail.Exception) as info:
        impl.assert_agrees(cases)
    message = str(info.value)
    assert "disagrees with the reference on 4 of 6 config(s)" in message
    for label in ("c1", "c2", "c4", "c5"):
        assert f"  {label} " in message
    assert "  c0 " not in message and "  c3 " not in message


def test_weightsync_only_scopes_the_eligibility_rows_too(pytester):
    # a run narrowed to another implementation runs no eligibility test of the reference ...
    other = run_suite(pytester, "--weightsync-only", "acme", "--co", "-q")
    assert not [line for line in other.stdout.lines if "::" in line and "[reference" in line]
    assert "empty parameter set" not in other.stdout.str()
    # ... and naming the reference keeps them
    named = run_suite(pytester, "--weightsync-only", "reference", "--co", "-q")
    assert [line for line in named.stdout.lines if "::" in line and "[reference" in line]
