"""What can go wrong in a rank, as exceptions that carry every rank's story.

The launcher never re-raises one rank's exception on its own: with several ranks the first
failure is often a symptom (a rank blocked in a collective because its peer crashed), so the
error keeps the outcome of every rank and renders them all in its message.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """What one rank reported (or what the launcher saw of it) for one call.

    ``kind`` is ``"error"`` (it raised), ``"died"`` (its process exited without answering),
    ``"hung"`` (still running at the deadline, killed), ``"stalled"`` (still running a
    grace period after another rank failed, killed) or ``"out-of-step"`` (the call returned
    but a fresh collective after it came out wrong or never completed). ``detail`` is the
    formatted traceback, the Python stack dumped from the live process, or the stack
    faulthandler wrote when the process crashed.
    """

    rank: int
    kind: str
    summary: str
    detail: str = ""
    exception: BaseException | None = dataclasses.field(default=None, compare=False)


class RankPoolError(RuntimeError):
    """Base class of the launcher's errors."""


class RankFailed(RankPoolError):
    """One or more ranks failed; ``outcomes`` holds each failing or killed rank's story."""

    def __init__(self, headline: str, outcomes: list[RankOutcome]):
        self.headline = headline
        self.outcomes = list(outcomes)
        super().__init__(render(headline, self.outcomes))

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes]


class RankTimeout(RankFailed):
    """Ranks were still running at the deadline; each hung rank's Python stack is attached."""


class RankOutOfStep(RankFailed):
    """The call returned in every rank but left the ranks out of step.

    A collective is still pending on some ranks only (an ``async_op=True`` work never waited,
    or a collective that only some ranks issued): the next call's first collective would pair
    with it and compute wrong data. Raised for the call that left it, and the pool restarts.
    """


class RankStartupError(RankFailed):
    """The rank processes could not be started or could not form their process group."""


class RankSkipped(RankPoolError):
    """A rank called ``pytest.skip``; the whole call counts as skipped with that reason."""

    def __init__(self, reason: str, rank: int):
        self.reason = reason
        self.rank = rank
        super().__init__(f"rank {rank} skipped: {reason}")


def render(headline: str, outcomes: list[RankOutcome]) -> str:
    """One block per rank, in rank order, so the report reads top to bottom."""
    lines = [headline]
    for outcome in sorted(outcomes, key=lambda o: o.rank):
        lines.append(f"---------- rank {outcome.rank}: {outcome.summary} ----------")
        if outcome.detail:
            lines.append(outcome.detail.rstrip("\n"))
    return "\n".join(lines)


class RankLeakWarning(UserWarning):
    """A call returned in every rank but left something in the warm rank processes (process
    groups, threads, descriptors, child processes, changed global torch settings); the ranks
    were restarted. Emitted while the test that made the call runs, so pytest reports it
    against that test."""
