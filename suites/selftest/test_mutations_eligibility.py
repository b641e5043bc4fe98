"""Planted bugs in an eligibility function are caught by the inline-logprob suite, and the
failure names the field whose value decided the difference.

Each mutant is a correct third-party-style eligibility function (plain ``getattr`` reads of
the argparse Namespace, as slime/Relax code does) with one realistic bug. It runs through the
suite's own check (``EligibilityImpl.assert_agrees`` over the suite's decision table and
every-combination grid, configs parsed by the replica parsers); the failure must name the
deciding field - and must not blame a field read with a default that is the right value.
"""

from __future__ import annotations

import pytest

from ..harness import eligibility as suite
from pytest_weightsync.eligibility import EligibilityImpl

pytestmark = pytest.mark.weightsync_property("mutation_detected")


def correct(args, *, kl_ok=lambda kl: kl == 0, staleness_default=0, read_staleness=True,
            extra=lambda args: True):
    if not args.colocate:
        return False
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        if args.num_steps_per_rollout != 1:
            return False
    elif args.global_batch_size != samples:
        return False
    if read_staleness and getattr(args, "max_staleness", staleness_default) != 0:
        return False
    if args.update_weights_interval != 1 or args.partial_rollout or args.use_rollout_logprobs:
        return False
    if args.use_routing_replay and not args.use_rollout_routing_replay:
        return False
    return kl_ok(args.kl_coef) and extra(args)


MUTANTS = {
    # (function, the field its failure must name, the hint line that names it)
    "ignores_kl_sign": (lambda a: correct(a, kl_ok=lambda kl: kl <= 0), "kl_coef", "decided"),
    "kl_threshold": (lambda a: correct(a, kl_ok=lambda kl: abs(kl) < 0.01), "kl_coef", "decided"),
    "ignores_max_staleness": (lambda a: correct(a, read_staleness=False), "max_staleness",
                              "decided"),
    "staleness_default_1": (lambda a: correct(a, staleness_default=1), "max_staleness",
                            "does not carry"),
    "reads_absent_partial_flag": (
        lambda a: correct(a, extra=lambda a: not getattr(a, "rl_partial_rollouts", True)),
        "rl_partial_rollouts", "does not carry"),
    "blocks_on_in_loss_kl": (
        lambda a: correct(a, extra=lambda a: not a.use_kl_loss), "use_kl_loss", "decided"),
    "ignores_update_interval": (
        lambda a: correct(a, extra=lambda a: True) or (
            a.update_weights_interval != 1 and correct(
                _with(a, update_weights_interval=1))), "update_weights_interval", "decided"),
}


def _with(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def _failure(func, name):
    impl = EligibilityImpl(name, func)
    messages = []
    for framework in suite.FRAMEWORKS:
        for cases in (suite.table_cases(framework), suite.every_combination(framework)):
            try:
                impl.assert_agrees(cases)
            except pytest.fail.Exception as failure:
                messages.append(str(failure))
    return messages


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_eligibility_mutant_is_caught_naming_the_deciding_field(mutant):
    func, field, kind = MUTANTS[mutant]
    messages = _failure(func, mutant)
    assert messages, f"{mutant} passed the inline-logprob suite"
    hint = ("the difference is decided by field(s):" if kind == "decided"
            else "it read field(s) that the config does not carry:")
    named = [m for m in messages if hint in m and f"{field!r}" in m.split(hint, 1)[1]]
    assert named, f"no failure of {mutant} names {field!r}:\n" + "\n---\n".join(messages)


def test_a_right_default_for_an_absent_field_is_not_blamed():
    """``getattr(args, "max_staleness", 0)`` is right on slime; with a kl-sign bug planted the
    failures name kl_coef and never max_staleness."""
    messages = _failure(lambda a: correct(a, kl_ok=lambda kl: kl <= 0), "kl_sign_only")
    assert messages
    for message in messages:
        assert "does not carry" not in message, message
        assert "'kl_coef'" in message.split("decided by field(s):", 1)[1], message


def test_the_unmutated_function_passes_the_same_checks():
    assert _failure(correct, "correct") == []
