"""The verdict rules, case by case, on outcomes alone (``pytest_weightsync.verdict.decide``).

The end-to-end proofs - real runs interrupted, narrowed, stopped early - are in
``tests/test_verdicts.py``; this file pins every rule so a change to one shows here first.
"""

from __future__ import annotations

from pytest_weightsync.report_results import TestResult
from pytest_weightsync.verdict import Outcome, decide


def o(nodeid, outcome, kind=None, reason="", counts=True, prop=None):
    return Outcome(nodeid, outcome, kind, reason, counts, prop)


def test_every_selected_case_ran_and_passed_is_pass():
    v = decide([o("a", "passed"), o("b", "skipped", "unclaimed")], selected=["a", "b"])
    assert (v.word, str(v)) == ("PASS", "PASS")


def test_a_failure_is_fail_whatever_else():
    v = decide([o("a", "passed"), o("b", "failed")], selected=["a", "b", "c"], deselected=3)
    assert v.word == "FAIL" and "1 failed" in str(v)


def test_a_selected_case_without_a_result_is_interrupted():
    v = decide([o("a", "passed"), o("b", "not run")], selected=["a", "b", "c"],
               interrupted=True)
    assert v.word == "INTERRUPTED" and "2 selected but not run" in str(v)


def test_deselected_or_uncollected_or_claimed_but_skipped_is_partial():
    assert decide([o("a", "passed")], selected=["a"], deselected=2).word == "PARTIAL"
    assert decide([o("a", "passed")], selected=["a"],
                  missing_modules=["test_random"]).word == "PARTIAL"
    v = decide([o("a", "passed"), o("b", "skipped", None, "megatron-core is not installed")],
               selected=["a", "b"])
    assert v.word == "PARTIAL" and "megatron-core is not installed" in str(v)


def test_outside_the_claims_counts_for_nothing():
    v = decide([o("a", "skipped", "unclaimed"), o("b", "skipped", "not_applicable")],
               selected=["a", "b"])
    assert v.word == "NOT RUN" and "not claimed" in str(v)


def test_a_missing_gpu_is_listed_but_does_not_make_it_partial():
    v = decide([o("a", "passed"), o("g", "skipped", "no_device", "needs 1 CUDA GPU(s): none")],
               selected=["a", "g"])
    assert v.word == "PASS" and str(v) == ("PASS (1 GPU case(s) not run here: needs 1 CUDA "
                                           "GPU(s): none)")


def test_report_only_tests_must_not_fail_but_their_skips_do_not_count():
    skip = o("h", "skipped", None, "no GPU", counts=False)
    assert decide([o("a", "passed"), skip], selected=["a", "h"]).word == "PASS"
    assert decide([o("a", "passed"), o("h", "failed", counts=False)],
                  selected=["a", "h"]).word == "FAIL"
    # and a passing report proves no property on its own
    assert decide([o("h", "passed", counts=False)], selected=["h"]).word == "NOT RUN"


def test_a_test_whose_setup_passed_and_never_reached_its_call_did_not_run():
    class Report:
        def __init__(self, when, outcome):
            self.when, self.duration, self.location = when, 0.0, None
            self.passed, self.failed, self.skipped = (outcome == x for x in
                                                      ("passed", "failed", "skipped"))

    result = TestResult("t", {})
    result.update(Report("setup", "passed"))
    assert result.outcome == "not run"
    result.update(Report("call", "passed"))
    result.update(Report("teardown", "passed"))
    assert result.outcome == "passed"


def test_a_claimed_property_that_no_case_fits_is_named_and_not_pass():
    outside = o("i1", "skipped", "outside_topologies", "x its topology predicate refuses this "
                "receiver", prop="identity")
    unclaimed = o("i2", "skipped", "unclaimed", "x does not claim the engine layout",
                  prop="identity")
    ran = o("b", "passed", prop="bit_exact")
    v = decide([ran, outside, unclaimed], selected=["b", "i1", "i2"])
    assert v.word == "PARTIAL" and set(v.unrun) == {"identity"}, v
    assert ("identity: NOT RUN - no case fits this implementation's topologies (1 case(s) "
            "refused: x its topology predicate refuses this receiver)") in str(v)
    # nothing ran at all: NOT RUN, naming it
    v = decide([outside], selected=["i1"])
    assert v.word == "NOT RUN" and "identity: NOT RUN" in str(v)


def test_a_property_that_ran_somewhere_or_has_nothing_to_check_is_not_named():
    outside = o("i1", "skipped", "outside_topologies", "refused", prop="identity")
    for other in (o("i2", "passed", prop="identity"),
                  o("i2", "skipped", "not_applicable", "nothing to route", prop="identity")):
        v = decide([outside, other], selected=["i1", "i2"])
        assert not v.unrun and v.word == ("PASS" if other.outcome == "passed" else "NOT RUN"), v
    # a property the implementation does not have: every skip is "unclaimed"
    v = decide([o("b", "passed", prop="bit_exact"),
                o("v", "skipped", "unclaimed", "does not claim 'version'", prop="version")],
               selected=["b", "v"])
    assert (v.word, v.unrun) == ("PASS", {})


def test_a_property_whose_other_cases_need_a_gpu_keeps_pass_and_is_named_not_run_here():
    v = decide([o("b", "passed", prop="bit_exact"),
                o("s1", "skipped", "outside_topologies", "refused", counts=False, prop="speed"),
                o("s2", "skipped", "no_device", "needs 1 CUDA GPU(s): none", counts=False,
                  prop="speed")], selected=["b", "s1", "s2"])
    assert v.word == "PASS" and not v.unrun, v
    assert "speed: not run here - no CPU case fits, 1 GPU case(s)" in str(v), str(v)


def test_no_fit_is_claimed_only_of_a_whole_run():
    """The fitting cases may be the ones deselected or never reached: no NOT RUN naming then."""
    outside = o("i1", "skipped", "outside_topologies", "refused", prop="identity")
    ran = o("b", "passed", prop="bit_exact")
    assert decide([ran, outside], selected=["b", "i1", "i2"], interrupted=True).unrun == {}
    assert decide([ran, outside], selected=["b", "i1"], deselected=1).unrun == {}
    assert decide([ran, outside], selected=["b", "i1"],
                  missing_modules=["test_lifecycle"]).unrun == {}
    assert set(decide([ran, outside], selected=["b", "i1"]).unrun) == {"identity"}
