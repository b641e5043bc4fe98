"""Planted lifecycle bugs are killed by the lifecycle conformance tests - each one named.

Each mutant is the reference implementation with one bug of the kind the 2026 reports around
the update describe (``../shared/DOMAIN.md`` section 10), run through the unchanged tests of
``suites/conformance/test_lifecycle.py``:

- ``publish_after_failed_chunk``: ``end_update`` publishes the next version whether or not
  the update completed (tokenspeed#672);
- ``partial_advance``: a failed update's buckets stay applied and the engine keeps saying the
  old version - its ``end_update`` takes what came, its version ignores the failure
  (NeMo-RL#2444);
- ``post_load_before_writes``: each bucket's copy lands when the next call arrives (a write
  in flight), and ``end_update`` runs the post-load processing before the last one landed
  (prime-rl#2389);
- ``identity_corrupts_fused``: a reload (every update after the first) leaves layer 0's fused
  ``w13_weight`` with its gate/up halves swapped, as a reload into a buffer the engine
  re-ordered does (SkyRL#1680, vllm#48284);
- ``replica_skipped``: the MoE-DP replicas of a shard (``moe_dp_rank > 0``) take the update
  as delivered and write nothing;
- ``end_without_begin_reprocesses``: an ``end_update`` without a session post-processes the
  weights again, quietly (the transform re-run on transformed weights);
- ``version_per_bucket``: the version is published at every bucket (as SGLang's scheduler
  records ``weight_version`` after every ``update_weights_from_tensor`` call of a session);
- ``outside_session_keeps_version``: a bucket outside a session is written and the engine
  keeps saying its last complete version (the reference before its lifecycle was judged);
- ``warns_on_reload``: every reload logs a "Failed to load weights" warning, values intact;
- ``silent_mix``: an engine without a version whose ``end_update`` takes whatever came;
- ``double_begin_ignored``: a second ``begin_update`` while one is open does nothing (neither
  an error nor a restart);
- ``stuck_after_failure``: after a failed update every ``begin_update`` is refused, also after
  ``end_update``;
- ``version_skips_identity``: an update that brings the values the engine holds does not move
  the version (versions keyed by content: an identity sync looks like no update);
- ``version_bumped_twice``: the version counts ``begin_update`` and ``end_update`` both;
- ``one_session_per_rank``: the open update is kept per engine rank, not per parameter set, so
  a replica's ``begin_update`` takes over the session of the same rank of another replica;
- ``wake_loses_weights``: ``sleep(level=1)`` discards like level 2 (no offloaded copy), so
  ``wake_up`` brings back memory that holds anything;
- ``version_survives_discard``: after a level-2 sleep the engine still says its last version;
- ``partial_after_discard``: after a level-2 sleep, an ``end_update`` of an update that stopped
  short completes it (the engine trusts the weights it discarded to still be there);
- ``version_moves_on_value_change``: the version moves only when some value changed, compared
  as values (``torch.equal``: NaN != NaN), so an identity update of the full bit patterns
  looks like a change and only a FINITE identity update shows the bug;
- ``staged_double_begin_flushes``: a staging loader (``lifecycle_rows.Staging``) whose second
  ``begin_update`` writes what the open update staged and then restarts, still naming its
  last version over the mix - hidden when the restarted update completes, so the harness
  judges the second ``begin_update`` before it does;
- ``vllm_publishes_at_begin`` (on both vLLM-shaped engines): a vLLM-topology row
  (``lifecycle_rows.VllmRow``) that publishes the new version at ``begin_update``;
- ``vllm_sleep_loses_parameter``: a vLLM-topology row whose level-1 sleep keeps no offloaded
  copy of one parameter (the last layer's ``w2_weight``);
- ``refused_begin_writes``: a second ``begin_update`` refused as vLLM's worker refuses it
  (``lifecycle_rows.StrictSessions``), after resetting the layer it was about to re-process;
- ``level2_discards_router``: a level-2 sleep that also discards the router weight, which no
  expert update carries (so nothing ever restores it).

Killed means: the test raises a :class:`ConformanceError` whose first line names the bug.
Each mutant's correct twin (:data:`TWINS`; the unplanted reference unless named) passes the
same tests. The mutants and their table live in :mod:`lifecycle_mutants`.
"""

from __future__ import annotations

import pytest

from ..conformance import test_lifecycle as suite
from ..harness import cases, lifecycle
from ..harness.judge import ConformanceError
from .lifecycle_mutants import (
    ALSO,
    CHECKPOINT,
    MUTANTS,
    TWINS,
    ReplicaSkipped,
    VersionKeptWhileWriting,
)
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

pytestmark = pytest.mark.weightsync_property("mutation_detected")


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_lifecycle_mutant_is_killed_and_named(mutant):
    make, test, args, named = MUTANTS[mutant]
    with pytest.raises(ConformanceError) as caught:
        test(make(), *args)
    message = str(caught.value)
    assert message.splitlines()[0].startswith(named) or named in message.splitlines()[0], \
        message[:1200]
    for word in ALSO.get(mutant, ()):
        assert word in message, (word, message[:1500])


def test_the_coverage_record_names_the_ranks_covered():
    """The record a coverage check leaves lists exactly the ranks that hold the update."""
    records: list[str] = []
    case = cases.REPLICA_CASES[0]
    with pytest.raises(ConformanceError):
        lifecycle.check_coverage(ReplicaSkipped(), case, "compat", record=records.append)
    (text,) = records
    assert text.startswith(f"4 of {cases.ENGINE_REPLICAS * case.receiver.world_size} engine ranks")
    assert "dp1" not in text and "r1:dp0:ep0:tp1=rank1" in text, text
    records.clear()
    lifecycle.check_coverage(ReferenceImplementation(), case, "compat", record=records.append)
    assert records[0].startswith("8 of 8 engine ranks") and "r1:dp1:ep0:tp1=rank3" in records[0]


def test_reference_passes_the_same_tests():
    """Every test a mutant fails is passed by its correct twin - the unplanted reference unless
    :data:`TWINS` names another - same arguments (each twin, test and arguments once, however
    many mutants share them)."""
    ran = set()
    for mutant in sorted(MUTANTS):
        _, test, args, _ = MUTANTS[mutant]
        twin = TWINS.get(mutant, ReferenceImplementation)
        key = (twin, test.__name__, tuple(a for a in args if not callable(a)))
        if key not in ran:
            ran.add(key)
            test(twin(), *args)


def test_a_lifecycle_claim_needs_its_methods_and_a_known_word():
    """Claiming ``version`` without ``weight_version`` (or ``sessions`` without the hooks) is a
    usage error at registration; an unknown word is refused; an unclaimed part skips with the
    implementation's note."""
    from pytest_weightsync.protocols import Capabilities, protocol_problems

    class Plain:
        name = "plain"
        capabilities = Capabilities(lifecycle=("version", "sessions"))

        def load_weights(self, params, payload, *, format, spec, topology, rank):
            pass

    problems = " | ".join(protocol_problems(Plain()))
    assert "claims 'version' but it has no weight_version" in problems, problems
    assert "claims 'sessions' but it has no begin_update / end_update" in problems, problems
    assert not protocol_problems(ReferenceImplementation())
    with pytest.raises(ValueError, match="lifecycle"):
        Capabilities(lifecycle=("atomicity",))
    caps = Capabilities(lifecycle_note="the server keeps sessions")
    assert caps.lifecycle_refusal("sessions").endswith(": the server keeps sessions")
    assert ReferenceImplementation.capabilities.lifecycle_refusal("atomic") is None


def test_an_engine_naming_its_last_version_while_an_update_is_open_passes():
    """While an update is open the version may be the last complete one or None (the contract,
    docs/validate-your-loader.md): an in-place engine that keeps its label until the update
    completes is not flagged; a failed or abandoned update over changed bits still is."""
    impl = VersionKeptWhileWriting()
    suite.test_the_version_moves_once_per_completed_update(impl, CHECKPOINT)
    for probe in ("double_begin", "begin_after_failure"):
        suite.test_misuse_of_the_session_is_refused_or_harmless(impl, CHECKPOINT, probe)
