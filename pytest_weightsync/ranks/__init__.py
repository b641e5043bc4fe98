"""The multi-rank launcher: run a function (or a test body) in n torch.distributed ranks.

- :class:`RankPool` - warm rank processes usable as a library, with or without pytest.
- :func:`current` - the :class:`RankContext` (rank, world size, backend, device) of the
  running rank, or None outside one.
- errors: :class:`RankFailed`, :class:`RankTimeout`, :class:`RankOutOfStep`,
  :class:`RankStartupError`, :class:`RankSkipped`; :class:`RankLeakWarning` for a call that
  left something in the warm ranks.

The pytest side (the ``ranks`` marker and the ``rank_pool`` fixture) lives in
:mod:`pytest_weightsync.ranks.dispatch`. Nothing here imports torch: only the rank processes
do, so loading the plugin stays cheap.
"""

from pytest_weightsync.ranks.context import RankContext, current
from pytest_weightsync.ranks.errors import (
    RankFailed,
    RankLeakWarning,
    RankOutcome,
    RankOutOfStep,
    RankPoolError,
    RankSkipped,
    RankStartupError,
    RankTimeout,
)
from pytest_weightsync.ranks.pool import RankPool

__all__ = [
    "RankContext",
    "RankFailed",
    "RankLeakWarning",
    "RankOutOfStep",
    "RankOutcome",
    "RankPool",
    "RankPoolError",
    "RankSkipped",
    "RankStartupError",
    "RankTimeout",
    "current",
]
