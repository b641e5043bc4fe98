"""The update lifecycle of an engine-side loader, driven and judged (``test_lifecycle``).

A loader with ``begin_update`` / ``end_update`` is the engine end of a session: updates open,
stream, close - and fail, get abandoned, are repeated with the same weights, reach every rank
and replica, and move the engine's version. The public bugs of 2026 around the update (not
inside one bucket, ``../shared/DOMAIN.md`` section 10) are each one property, judged in a
module of its own; this module is the one import path for callers:

``identity`` (:mod:`.lifecycle_identity`)
    The engine's own weights sent back :data:`IDENTITY_SYNCS` times, each stream cut at
    another bucket limit: every parameter bit-identical after every sync, the engine's
    post-load processing included, the reference MoE forward on a fixed input unchanged, no
    warning raised or logged while loading (SkyRL#1680, vllm#48284, prime-rl#2714).
``atomic_update``, ``lifecycle`` (sessions) (:mod:`.lifecycle_failure`)
    An update that fails mid-stream (:data:`FAILURES`) leaves the old version bit for bit or
    the engine marked unusable - never a silent mix, never a version moved; a lost rank's
    update is abandoned the documented way (``end_update`` by the engine's controller) before
    the next one begins. Misuse of the session (:data:`PROBES`) is refused or handled as
    documented and never corrupts; a second ``begin_update`` is judged before the update it
    restarts or continues completes.
``coverage_by_rank`` (:mod:`.lifecycle_coverage`)
    Every engine rank of :data:`ENGINE_REPLICAS` engines (and every MoE-DP replica inside each)
    updated, their buckets interleaved; ranks holding the same shard bit-identical; the ranks
    covered recorded.
``version`` (:mod:`.lifecycle_version`)
    ``weight_version`` moves exactly once per completed update (a FINITE identity update
    included), never at ``begin_update``, a bucket or a failed update, and names a complete
    version only while the parameters hold it.
``lifecycle``, sleep and wake (claimed ``sleep``, :mod:`.lifecycle_sleep`)
    Level 1 restores every bit at its address; level 2 discards only what updates carry,
    leaves no complete version, and the next update must be complete.

Expected states come from the oracle (:func:`suites.harness.inputs.expected`, the synthetic
value function at layout coordinates), never from the loader; "unchanged" is the engine's
own bits before the step, snapshotted. The engine rank the properties drive and the version
rules they share are in :mod:`.lifecycle_engine`.
"""

from __future__ import annotations

from .cases import ENGINE_REPLICAS  # noqa: F401 - the coverage check's engine count
from .lifecycle_coverage import check_coverage, rank_key  # noqa: F401
from .lifecycle_engine import (  # noqa: F401
    IDENTITY_VERSION,
    EngineRank,
    attempt,
    bad_bucket,
    changed,
    engine_side,
    failure_point,
    identity_expected,
    identity_weights,
    require,
)
from .lifecycle_failure import FAILURES, PROBES, check_atomic, check_probe  # noqa: F401
from .lifecycle_identity import (  # noqa: F401
    FORWARD_TOKENS,
    IDENTITY_SYNCS,
    check_identity,
    forward,
)
from .lifecycle_sleep import SLEEP_LEVELS, check_sleep  # noqa: F401
from .lifecycle_version import check_version  # noqa: F401
