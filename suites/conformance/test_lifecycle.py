"""The update lifecycle of every registered loader: what happens around the buckets.

Each test runs once per registered implementation with a loader role and states one property
(judged in ``suites/harness/lifecycle.py``; the contract is in ``docs/validate-your-loader.md``,
"The update lifecycle"):

- ``identity``: every rank gets version 1, then three identity syncs (the engine's own weights
  sent back, each stream cut at another bucket limit): every parameter bit-identical after
  each, the engine's post-load processing included (``cases.LIFECYCLE_CASES``: a
  checkpoint-layout engine, the TRT-LLM BF16 block engine and the vLLM-shaped engines - EP
  over all ranks, MoE-TP over all ranks, uneven EP), the reference MoE forward on a fixed
  input unchanged and equal to the forward over the oracle's weights, no warning while
  loading;
- ``coverage_by_rank``: engines whose ranks share shards (``cases.REPLICA_CASES``: MoE-DP
  replicas, and the vLLM-shaped engines, whose replicas are whole engines), two engines each,
  every rank's session open at once and their buckets interleaved: every rank holds the
  update, ranks of the same shard bit-identical; the ranks covered are recorded
  (``ranks_covered`` in the JSON report);
- ``atomic_update`` (claimed ``atomic``): an update that fails mid-stream - a refused bucket,
  an exception in the sender, a lost rank (judged open, then ended with ``end_update`` as the
  engine's controller does) - leaves the old bits or the engine marked unusable, the version
  unmoved; the next full update is bit-exact;
- ``lifecycle`` (claimed ``sessions``): a bucket outside a session, a second
  ``begin_update`` (judged before the update it continues or restarts completes), an
  ``end_update`` without one, a ``begin_update`` after a failure: refused or handled as
  documented, never corrupting; the next full update lands;
- ``version`` (claimed ``version``): ``weight_version`` moves exactly once per completed
  update - a FINITE identity update too, where no bit changes - never at ``begin_update``, a
  bucket or a failed update, and names a version only while the parameters hold it;
- ``lifecycle`` again, sleep and wake (claimed ``sleep``): between updates the engine gives
  its weights' memory back and takes it again (vLLM's sleep levels): level 1 restores every bit
  at its address, level 2 discards only what updates carry and leaves no complete version
  until a complete update.

``identity`` and ``coverage_by_rank`` run for every loader (framed by its hooks when it has
them); the others only where ``Capabilities.lifecycle`` claims them - anything else is
skipped as not claimed, never passed.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import FORMATS, RANKS_COVERED

from ..harness import cases, lifecycle

ENGINES = [pytest.param(case, id=case.id) for case in cases.LIFECYCLE_CASES]
REPLICAS = [pytest.param(case, id=case.id) for case in cases.REPLICA_CASES]
#: One format per lifecycle test (the session, not the wire, is what these judge): the
#: first one the loader claims, in this order.
PREFERRED = ("compat", "hf_fused", "direct", "packed")


def _format(impl, case, claim=None) -> str:
    """The payload format the lifecycle tests of ``case`` use for ``impl`` (the first it claims
    of :data:`PREFERRED`); skipped where it claims none, or not the lifecycle ``claim``."""
    lifecycle.require(impl, case, None)
    claimed = [f for f in PREFERRED if impl.capabilities.format_refusal("loader", f,
                                                                        case.receiver) is None]
    if not claimed:
        lifecycle.require(impl, case, PREFERRED[0])  # skips, naming the formats it claims
    if claim is not None:
        lifecycle.require(impl, case, claimed[0], claim)
    return claimed[0]


@pytest.mark.weightsync_property("identity")
@pytest.mark.parametrize("payload_format", FORMATS)
@pytest.mark.parametrize("case", ENGINES)
def test_identity_syncs_change_no_bit(weightsync_loader, case, payload_format):
    lifecycle.require(weightsync_loader, case, payload_format)
    lifecycle.check_identity(weightsync_loader, case, payload_format)


@pytest.mark.weightsync_property("coverage_by_rank")
@pytest.mark.parametrize("case", REPLICAS)
def test_every_rank_and_replica_receives_the_update(weightsync_loader, case,
                                                   weightsync_record_property):
    fmt = _format(weightsync_loader, case)
    lifecycle.check_coverage(weightsync_loader, case, fmt,
                             record=lambda text: weightsync_record_property(
                                 f"weightsync_{RANKS_COVERED}", text))


@pytest.mark.weightsync_property("atomic_update")
@pytest.mark.parametrize("failure", lifecycle.FAILURES)
@pytest.mark.parametrize("case", ENGINES)
def test_a_failed_update_is_never_a_silent_mix(weightsync_loader, case, failure):
    fmt = _format(weightsync_loader, case, "atomic")
    lifecycle.check_atomic(weightsync_loader, case, fmt, failure)


@pytest.mark.weightsync_property("lifecycle")
@pytest.mark.parametrize("probe", lifecycle.PROBES)
@pytest.mark.parametrize("case", ENGINES)
def test_misuse_of_the_session_is_refused_or_harmless(weightsync_loader, case, probe):
    fmt = _format(weightsync_loader, case, "sessions")
    lifecycle.check_probe(weightsync_loader, case, fmt, probe)


@pytest.mark.weightsync_property("lifecycle")
@pytest.mark.parametrize("level", lifecycle.SLEEP_LEVELS)
@pytest.mark.parametrize("case", ENGINES)
def test_sleep_and_wake_between_updates(weightsync_loader, case, level):
    fmt = _format(weightsync_loader, case, "sleep")
    lifecycle.check_sleep(weightsync_loader, case, fmt, level)


@pytest.mark.weightsync_property("version")
@pytest.mark.parametrize("case", ENGINES)
def test_the_version_moves_once_per_completed_update(weightsync_loader, case):
    fmt = _format(weightsync_loader, case, "version")
    lifecycle.check_version(weightsync_loader, case, fmt)
