"""What one bucket will write, and what an open update has carried so far.

A :class:`LoadPlan` is a validated bucket turned into copies (and the padding it zeroes); an
:class:`UpdateState` is the bookkeeping that makes completeness a property of the update, not
of a bucket (which pieces earlier buckets carried, how buckets are numbered). Both are plain
records that receivers, the plan cache and the whole-model receiver pass between them, kept
apart from the receiver that makes them so a loader can hold an update's state without holding
a receiver; ``receiver`` re-exports them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["LoadPlan", "UpdateState"]


@dataclass
class LoadPlan:
    """What one bucket will do: zero ``zero`` views, then copy each ``(dst, src)`` pair.
    ``touched`` names the receiver parameters written, ``units`` the (layer, expert,
    projection) pieces the bucket carries (global expert ids, other ranks' included)."""

    pairs: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    touched: set = field(default_factory=set)
    ignored: int = 0
    units: dict = field(default_factory=dict)
    #: ``(owed, whether units cover it)`` for the last ``owed`` asked (see :meth:`covers`).
    covering: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def covers(self, owed: frozenset) -> bool:
        """Whether this bucket alone carried every piece of ``owed``; answered once per
        ``owed`` set, so a cached bucket replayed every update (the same plan object) closes
        its update without comparing every piece again."""
        memo = self.covering
        if memo is None or memo[0] is not owed:
            memo = self.covering = (owed, owed <= self.units.keys())
        return memo[1]


@dataclass
class UpdateState:
    """State of an open update: which pieces earlier buckets carried, and where. Buckets are
    numbered the way the sender numbers them: every bucket offered counts, refused ones
    included, so after a refused bucket 1 the next one is bucket 2 in every message."""

    seen: dict = field(default_factory=dict)  # (layer, expert, projection) -> (bucket, entry, name)
    offered: int = 0  # buckets offered so far; the next one is bucket number `offered`
    refused: int = 0
    #: Weak references to the plans whose pieces ``seen`` took (``end_update`` asks each
    #: plan still alive - a plan cache keeps its buckets' - whether it alone covered the
    #: update; ``seen`` decides when none did). Weak: a plan holds views of its bucket's
    #: tensors, which must not outlive the bucket's load because an update is open.
    carried: list = field(default_factory=list)

    def carry(self, plan: "LoadPlan") -> None:
        """One more bucket offered, written: its pieces are seen."""
        self.seen.update(plan.units)
        self.carried.append(weakref.ref(plan))
        self.offered += 1

    def covered(self, owed: frozenset) -> bool:
        """Whether one plan this update carried, still alive, covered ``owed`` alone."""
        return any(plan is not None and plan.covers(owed)
                   for plan in (ref() for ref in self.carried))

    def count_refused(self) -> None:
        """One more bucket offered, and refused."""
        self.offered += 1
        self.refused += 1
