"""An implementation's verdict: what the run proved about it, and nothing it did not run.

Inputs: the outcome of every conformance test that reported (:class:`Outcome`), the run's
selection (:class:`pytest_weightsync.selection.Selection`: which of the implementation's
tests were selected, deselected, which conformance modules were collected) and whether the
run was interrupted. Words (``pytest_weightsync.vocabulary``), worst first:

``FAIL``         some case failed (a conformance property, or a hardening probe that found a
                 refused bucket half written);
``INTERRUPTED``  the run stopped (Ctrl-C, ``-x`` / ``--maxfail``, a worker that died) before
                 every selected case had a result;
``PARTIAL``      nothing failed, but the run did not cover everything the implementation
                 claims: tests deselected (``-k``, ``-m``, ``--lf``), a conformance module not
                 collected (a narrower path, ``--lf`` skipping files), claimed cases skipped
                 for a reason outside the claims (a package that is not installed), or a
                 claimed property that no case ran for (below);
``NOT RUN``      no case ran at all (everything skipped as not claimed);
``WAIVED``       as PASS, but some failures were accepted by the run's waiver file
                 (:mod:`pytest_weightsync.waivers`): listed, never called PASS;
``PASS``         every selected case ran to a result, none failed, no claimed case was left out
                 (cases that need a GPU the machine lacks are listed: "PASS (12 GPU case(s)
                 not run here: ...)" certifies what ran, and says what did not).

A test counts as run only when its call phase reported (or its setup skipped or failed): a
test whose setup passed and that never reached its call - the Ctrl-C case - did not run; nor
did a case skipped as ``not_run`` (``vocabulary.SKIP_NOT_RUN``: an implementation cut off
after repeated call time-outs, :mod:`pytest_weightsync.cutoff`), which the verdict lists with
its reason.
Cases the implementation does not claim, and properties with nothing to check on it
(``vocabulary.SKIP_UNCLAIMED`` / ``SKIP_NOT_APPLICABLE``), neither count for nor against it.

Every claim runs: a property the implementation has must have run (passed or failed) on at
least one case. A property whose every test was refused as a case outside the implementation's
declared topologies, trainer layouts, formats or deliveries (``vocabulary.SKIP_OUTSIDE``: a
loader restricted to vLLM topologies, none of the property's cases among them) never ran;
the verdict names it - "identity: NOT RUN - no case fits this implementation's topologies" -
and is not PASS (PARTIAL, or NOT RUN when nothing ran at all). Where some of that property's
cases were GPU cases on a machine without the GPUs, the existing rule for absent hardware
holds: the verdict stays PASS and names the property as not run here. Skips of a property the
implementation does not have (not claimed, not applicable) never make it one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pytest_weightsync.vocabulary import (
    FAIL,
    INTERRUPTED,
    NOT_RUN,
    OUTCOME_WAIVED,
    PARTIAL,
    PASS,
    SKIP_NO_DEVICE,
    SKIP_NOT_APPLICABLE,
    SKIP_NOT_RUN,
    SKIP_OUTSIDE,
    SKIP_UNCLAIMED,
    WAIVED,
)

#: Skip kinds that are outside the implementation's claims (case by case).
OUTSIDE_CLAIMS = (SKIP_UNCLAIMED, SKIP_NOT_APPLICABLE, SKIP_OUTSIDE)
#: What a claimed property that no case fits is called in a verdict.
NO_FIT = "NOT RUN - no case fits this implementation's topologies"
#: Reasons listed in a verdict's detail (the count is always given).
MAX_REASONS = 3


@dataclass
class Outcome:
    """What one test of an implementation came to: ``passed``, ``failed``, ``waived`` (a
    failure its waiver accepted), ``skipped`` or ``not run`` (no result: setup only, or
    nothing at all), and for a skip its kind."""

    nodeid: str
    outcome: str
    skip_kind: Optional[str] = None
    reason: str = ""
    #: False for a report-only test (hardening, speed): its failure fails the verdict, but its
    #: pass proves no property and its skip leaves nothing claimed out
    counts: bool = True
    #: the conformance property the test checks (``None``: not known)
    prop: Optional[str] = None


@dataclass
class Verdict:
    word: str
    ran: int = 0           # tests with a result (passed, failed, skipped)
    total: int = 0         # tests selected + deselected
    details: list = field(default_factory=list)
    #: claimed properties no case ran for: ``{property: why}`` (:func:`unrun_claims`)
    unrun: dict = field(default_factory=dict)

    def __str__(self) -> str:
        if self.word == PASS:
            return PASS + (f" ({'; '.join(self.details)})" if self.details else "")
        if self.word == WAIVED:
            return f"{WAIVED} ({'; '.join(self.details)})"
        if self.word == NOT_RUN:
            return f"{NOT_RUN} ({'; '.join(self.details) or 'no case ran'})"
        inner = f"{self.ran}/{self.total} ran" + ("; " + "; ".join(self.details)
                                                  if self.details else "")
        return f"{self.word} ({inner})"

    def to_dict(self) -> dict:
        return {"word": self.word, "ran": self.ran, "total": self.total,
                "details": list(self.details), "claims_not_run": dict(self.unrun)}


def decide(outcomes: list[Outcome], *, selected: Optional[list] = None, deselected: int = 0,
           missing_modules=(), interrupted: bool = False,
           selection_known: bool = True) -> Verdict:
    """The verdict of one implementation (see the module docstring). ``outcomes`` are its
    reported tests; ``selected`` the node ids the run selected for it (``None``: unknown)."""
    by_id = {o.nodeid: o for o in outcomes}
    if selected is None:
        selected = list(by_id)
    wanted = list(dict.fromkeys([*selected, *by_id]))
    results = [by_id.get(n) for n in wanted]
    not_run = [o for o in results if o is not None and o.outcome == "skipped"
               and o.skip_kind == SKIP_NOT_RUN]
    done = [o for o in results if o is not None and o.outcome != "not run"
            and not (o.outcome == "skipped" and o.skip_kind == SKIP_NOT_RUN)]
    unreached = len(wanted) - len(done) - len(not_run)
    total = len(wanted) + deselected
    failed = [o for o in done if o.outcome == "failed"]
    claimed_skips = [o for o in done if o.outcome == "skipped" and o.counts
                     and o.skip_kind not in OUTSIDE_CLAIMS and o.skip_kind != SKIP_NO_DEVICE]
    no_device = [o for o in done if o.outcome == "skipped" and o.counts
                 and o.skip_kind == SKIP_NO_DEVICE]
    ran_cases = [o for o in done if o.outcome in ("passed", "failed") and o.counts]
    waived = [o for o in done if o.outcome == OUTCOME_WAIVED]
    # only a whole run shows that no case fits: deselected, uncollected or unreached tests
    # may be the very ones that fit (the verdict says those already)
    whole = not (unreached or deselected or missing_modules or not selection_known)
    unrun, here = unrun_claims(results) if whole else ({}, {})

    details = []
    if failed:
        details.append(f"{len(failed)} failed")
    if waived:
        details.append(f"{len(waived)} waived: {_reasons(waived, 160)}")
    if unreached:
        details.append(f"{unreached} selected but not run")
    if deselected:
        details.append(f"{deselected} deselected")
    if missing_modules:
        details.append("not collected: " + ", ".join(missing_modules))
    if not_run:
        details.append(f"{len(not_run)} not run: {_reasons(not_run, 240)}")
    if claimed_skips:
        details.append(f"{len(claimed_skips)} claimed case(s) skipped: "
                       f"{_reasons(claimed_skips, 120)}")
    if not selection_known:
        details.append("selection unknown (a worker went down before reporting it)")
    unrun_notes = [f"{prop}: {why}" for prop, why in unrun.items()]
    details += unrun_notes
    device_note = "; ".join(
        ([f"{len(no_device)} GPU case(s) not run here: {no_device[0].reason}"] if no_device
         else []) + [f"{prop}: {why}" for prop, why in here.items()])

    if failed:
        word = FAIL
    elif unreached or (interrupted and not selection_known):
        word = INTERRUPTED  # something stopped the run before these had a result
    elif (deselected or missing_modules or claimed_skips or not_run or not selection_known
          or (unrun and (ran_cases or waived))):
        word = PARTIAL
    elif not ran_cases and not waived:
        word = NOT_RUN
        details = unrun_notes + ([device_note] if device_note else [] if unrun_notes else
                                 ["every case was skipped as not claimed" if done
                                  else "no case was selected"])
    elif waived:
        word = WAIVED
        details = details + ([device_note] if device_note else [])
    else:
        word = PASS
        details = [device_note] if device_note else []
    if device_note and word != PASS and device_note not in details:
        details.append(device_note)
    return Verdict(word, ran=len(done), total=total, details=details, unrun=unrun)


def unrun_claims(outcomes) -> tuple[dict, dict]:
    """The claimed properties that no case ran for: ``({property: why}, {property: why})``,
    the first those that make a verdict short of PASS, the second those whose only cases
    that might fit needed a GPU the machine lacks (named, the verdict kept). A property is
    one of these when none of its tests passed or failed, at least one was refused as a case
    outside the implementation's declared topologies (``SKIP_OUTSIDE``: it has the property,
    the case did not fit), and none says otherwise: not applicable (the property has nothing
    to check), without a result or skipped for a missing package (the verdict says those)."""
    groups: dict = {}
    for o in outcomes:
        if o is not None and o.prop:
            groups.setdefault(o.prop, []).append(o)
    short, here = {}, {}
    for prop, group in groups.items():
        kinds = {o.skip_kind if o.outcome == "skipped" else o.outcome for o in group}
        if SKIP_OUTSIDE not in kinds or not kinds <= {SKIP_OUTSIDE, SKIP_UNCLAIMED,
                                                      SKIP_NO_DEVICE}:
            continue  # it ran, or has nothing to check, or the verdict says why not already
        outside = [o for o in group if o.skip_kind == SKIP_OUTSIDE]
        why = f"{len(outside)} case(s) refused: {_reasons(outside, 120)}"
        if SKIP_NO_DEVICE in kinds:
            gpu = sum(1 for o in group if o.skip_kind == SKIP_NO_DEVICE)
            here[prop] = f"not run here - no CPU case fits, {gpu} GPU case(s) ({why})"
        else:
            short[prop] = f"{NO_FIT} ({why})"
    return short, here


def _reasons(outcomes: list[Outcome], width: int) -> str:
    """The distinct first lines of the outcomes' reasons, the first :data:`MAX_REASONS`."""
    reasons = sorted({o.reason.splitlines()[0] if o.reason else "no reason" for o in outcomes})
    shown = "; ".join(r[:width] for r in reasons[:MAX_REASONS])
    more = f" (+{len(reasons) - MAX_REASONS} more reasons)" if len(reasons) > MAX_REASONS else ""
    return shown + more
