"""The run-time half of the inline-logprob decision: did this rollout come from these weights?

:func:`~pytest_weightsync.reference_impl.rl.inline_logprob.inline_logprob_eligibility` decides
from the config alone whether the old-policy forward may be skipped: it can be exact only when
every token of a rollout was produced by the weights the optimizer step starts from. A partial
rollout, a staleness above 0 or a refit while a request ran breaks that per token, not per
config. So a rollout is eligible only if

1. the config decision says so;
2. every token's reported weight version equals the version the optimizer step starts from
   (a token without a version is not known to be the policy's);
3. where both are measured, the engine's log-prob of every token equals the trainer
   forward's (bit for bit, or within a declared tolerance).

Each failed condition is a :class:`TokenReason` naming the rollout, the token index and what it
held, so a mixed-version rollout is located, not just refused. Torch-free: log-probs are
plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Rollout", "RuntimeDecision", "TokenReason", "runtime_decision"]


@dataclass(frozen=True)
class Rollout:
    """One rollout as the trainer receives it: an id, each output token's weight version, and
    (optionally) the engine's log-prob of each token."""

    rid: str
    token_versions: Sequence
    logprobs: Optional[Sequence[float]] = None


@dataclass(frozen=True)
class TokenReason:
    """Why a rollout is not eligible: the rollout, the first token index concerned, what it
    holds and what it would need."""

    rid: str
    index: Optional[int]
    held: object
    needs: str

    def __str__(self) -> str:
        at = "" if self.index is None else f" token {self.index}"
        return f"{self.rid}{at}: {self.held!r}: {self.needs}"


@dataclass(frozen=True)
class RuntimeDecision:
    """Eligible only if the config decision and every rollout agree; every reason against."""

    eligible: bool
    config_eligible: bool
    reasons: tuple


def runtime_decision(config_eligible: bool, rollouts, step_version, *,
                     trainer_logprobs: Optional[dict] = None,
                     tolerance: Optional[float] = None) -> RuntimeDecision:
    """The decision for the rollouts of one optimizer step that starts from ``step_version``.
    ``trainer_logprobs``: ``{rid: [float]}`` of the trainer's forward on each rollout's tokens
    (the third condition is checked where given and where the rollout carries log-probs);
    ``tolerance``: ``None`` for bit-exact."""
    reasons = []
    for rollout in rollouts:
        versions = list(rollout.token_versions)
        stale = next((i for i, v in enumerate(versions) if v != step_version), None)
        if not versions:
            reasons.append(TokenReason(rollout.rid, None, versions,
                                       "no token versions reported: not known to be the policy's"))
        elif stale is not None:
            others = sorted({repr(v) for v in versions if v != step_version})
            reasons.append(TokenReason(
                rollout.rid, stale, versions[stale],
                f"the step starts from version {step_version!r}; tokens {stale}.. include "
                f"versions {', '.join(others)} (a partial rollout, staleness or a refit while "
                f"it ran)"))
        mine = None if trainer_logprobs is None else trainer_logprobs.get(rollout.rid)
        if mine is not None and rollout.logprobs is not None:
            for index, (got, want) in enumerate(zip(rollout.logprobs, mine)):
                off = (got != want) if tolerance is None else not abs(got - want) <= tolerance
                if off:
                    bound = "bit for bit" if tolerance is None else f"within {tolerance}"
                    reasons.append(TokenReason(rollout.rid, index, got,
                                               f"the trainer's forward gives {want!r} ({bound})"))
                    break
            if len(rollout.logprobs) != len(mine):
                reasons.append(TokenReason(rollout.rid, None, len(rollout.logprobs),
                                           f"the trainer scored {len(mine)} tokens"))
    return RuntimeDecision(bool(config_eligible) and not reasons, bool(config_eligible),
                           tuple(reasons))
