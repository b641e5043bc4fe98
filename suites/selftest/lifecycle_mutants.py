"""The planted lifecycle bugs and the table that says which conformance test must kill each
and with what name: ``test_mutations_lifecycle.py`` (whose docstring tells each bug and the
report behind it) runs them, and its contract tests reuse two of them.

Each mutant is the reference implementation (or a self-test row of :mod:`lifecycle_rows`)
with one bug; :data:`TWINS` names a mutant's correct twin where it is not the reference.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..conformance import test_lifecycle as suite
from ..harness import cases
from .lifecycle_rows import Staging, StrictSessions, VllmRow
from pytest_weightsync.compare import same_bits
from pytest_weightsync.reference_impl.engine.receiver import IncompleteUpdateError
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import fused_name, receiver_shard

__all__ = ["ALSO", "CHECKPOINT", "MUTANTS", "TRTLLM", "TWINS", "VLLM_EP", "VLLM_TP",
           "ReplicaSkipped", "VersionKeptWhileWriting"]

CHECKPOINT, TRTLLM = cases.LIFECYCLE_CASES[:2]
assert TRTLLM.receiver.engine_layout == "trtllm_block"
VLLM_EP, VLLM_TP = cases.VLLM_LIFECYCLE_CASES
assert VLLM_EP.receiver.moe_ep == VLLM_EP.receiver.tp > 1 and VLLM_TP.receiver.moe_tp > 1


class PublishAfterFailedChunk(ReferenceImplementation):
    name = "publish_after_failed_chunk"

    def end_update(self, params, **kwargs):
        try:
            super().end_update(params, **kwargs)
        finally:  # the version is published whatever happened to the update
            held = self._find_held(params)
            if held is not None and not held.usable:
                held.completed += 1
                held.usable = True


class PartialAdvance(ReferenceImplementation):
    name = "partial_advance"

    def end_update(self, params, **kwargs):
        try:
            super().end_update(params, **kwargs)
        except IncompleteUpdateError:
            pass  # "the buckets that came are applied"

    def weight_version(self, params, **kwargs):
        held = self._find_held(params)
        return None if held is None else held.completed  # the failure is not remembered


class PostLoadBeforeWrites(ReferenceImplementation):
    name = "post_load_before_writes"

    def __init__(self):
        super().__init__()
        self._in_flight = {}

    def load_weights(self, params, payload, **kwargs):
        landing = self._in_flight.pop(id(params), None)
        if landing is not None:  # the previous bucket's write lands now
            super().load_weights(params, landing, **kwargs)
        self._in_flight[id(params)] = [(n, t.clone()) for n, t in payload]

    def end_update(self, params, *, spec, topology, rank, **kwargs):
        receiver = self._receiver(params, spec, topology, rank)
        if hasattr(receiver, "post_load"):
            receiver.post_load()  # post-processing first ...
        landing = self._in_flight.pop(id(params), None)
        if landing is not None:  # ... then the last write lands
            super().load_weights(params, landing, spec=spec, topology=topology, rank=rank,
                                 **kwargs)
        super().end_update(params, spec=spec, topology=topology, rank=rank, **kwargs)


class IdentityCorruptsFused(ReferenceImplementation):
    name = "identity_corrupts_fused"

    def end_update(self, params, **kwargs):
        super().end_update(params, **kwargs)
        if self._find_held(params).completed > 1:  # a reload: w13 written in the stale order
            w13 = params[fused_name(0, "w13")]
            half = w13.shape[1] // 2
            with torch.no_grad():
                w13.copy_(torch.cat([w13[:, half:], w13[:, :half]], dim=1))


class ReplicaSkipped(ReferenceImplementation):
    name = "replica_skipped"

    @staticmethod
    def _replica(spec, topology, rank) -> bool:
        return receiver_shard(spec, topology, rank).moe_dp_rank > 0

    def begin_update(self, params, *, spec, topology, rank, **kwargs):
        if not self._replica(spec, topology, rank):
            super().begin_update(params, spec=spec, topology=topology, rank=rank, **kwargs)

    def load_weights(self, params, payload, *, spec, topology, rank, **kwargs):
        if not self._replica(spec, topology, rank):
            super().load_weights(params, payload, spec=spec, topology=topology, rank=rank,
                                 **kwargs)

    def end_update(self, params, *, spec, topology, rank, **kwargs):
        if not self._replica(spec, topology, rank):
            super().end_update(params, spec=spec, topology=topology, rank=rank, **kwargs)


class EndWithoutBeginReprocesses(ReferenceImplementation):
    name = "end_without_begin_reprocesses"

    def end_update(self, params, *, spec, topology, rank, **kwargs):
        if self._find_open(params) is not None:
            return super().end_update(params, spec=spec, topology=topology, rank=rank, **kwargs)
        receiver = self._receiver(params, spec, topology, rank)
        for name, param in receiver._param_kinds():  # post-process again, quietly
            tensor = receiver.params[name]
            if engine_layout.held_layout(tensor) is not None:
                delattr(tensor, engine_layout.MARK)
            engine_layout.apply_post_load(tensor, param, topology.engine_layout)


class VersionPerBucket(ReferenceImplementation):
    name = "version_per_bucket"

    def load_weights(self, params, payload, **kwargs):
        super().load_weights(params, payload, **kwargs)
        held = self._find_held(params)
        if held is not None:
            held.completed += 1
            held.usable = True

    def weight_version(self, params, **kwargs):
        held = self._find_held(params)
        return None if held is None or not held.usable else held.completed

    def begin_update(self, params, **kwargs):
        held = self._find_held(params)
        usable = held is not None and held.usable
        super().begin_update(params, **kwargs)
        self._find_held(params).usable = usable  # the engine keeps serving its version


class OutsideSessionKeepsVersion(ReferenceImplementation):
    name = "outside_session_keeps_version"

    def load_weights(self, params, payload, **kwargs):
        held = self._find_held(params)
        usable = held is not None and held.usable and self._find_open(params) is None
        super().load_weights(params, payload, **kwargs)
        if usable:
            held.usable = True


class WarnsOnReload(ReferenceImplementation):
    name = "warns_on_reload"

    def load_weights(self, params, payload, **kwargs):
        super().load_weights(params, payload, **kwargs)
        held = self._find_held(params)
        if held is not None and held.completed:
            logging.getLogger("engine.loader").warning(
                "Failed to load weights for 1 parameter(s); they keep their previous values")


class SilentMix(PartialAdvance):
    name = "silent_mix"
    capabilities = replace(ReferenceImplementation.capabilities,
                           lifecycle=frozenset({"sessions", "atomic"}))
    weight_version = None  # no version: end_update completing is all a caller sees


class DoubleBeginIgnored(ReferenceImplementation):
    name = "double_begin_ignored"

    def begin_update(self, params, **kwargs):
        if self._find_open(params) is None:
            super().begin_update(params, **kwargs)


class StuckAfterFailure(ReferenceImplementation):
    name = "stuck_after_failure"

    def __init__(self):
        super().__init__()
        self._failed = set()

    def load_weights(self, params, payload, **kwargs):
        try:
            super().load_weights(params, payload, **kwargs)
        except Exception:
            self._failed.add(id(params))
            raise

    def begin_update(self, params, **kwargs):
        if id(params) in self._failed:
            raise RuntimeError("an update failed on these weights: restart the engine")
        super().begin_update(params, **kwargs)


class VersionSkipsIdentity(ReferenceImplementation):
    name = "version_skips_identity"

    def begin_update(self, params, **kwargs):
        super().begin_update(params, **kwargs)
        self._before = {n: t.clone() for n, t in params.items()}

    def end_update(self, params, **kwargs):
        super().end_update(params, **kwargs)
        if all(same_bits(t, self._before[n]) for n, t in params.items()):
            self._find_held(params).completed -= 1  # "nothing changed"


class VersionBumpedTwice(ReferenceImplementation):
    name = "version_bumped_twice"

    def begin_update(self, params, **kwargs):
        super().begin_update(params, **kwargs)
        self._find_held(params).completed += 1


class OneSessionPerRank(ReferenceImplementation):
    name = "one_session_per_rank"

    def __init__(self):
        super().__init__()
        self._by_rank = {}

    def _check(self, params, rank):
        if self._by_rank.get(rank, params) is not params:
            raise RuntimeError(f"rank {rank} has no open update on these parameters")

    def begin_update(self, params, *, rank, **kwargs):
        self._by_rank[rank] = params  # the rank's session, whatever replica it belongs to
        super().begin_update(params, rank=rank, **kwargs)

    def load_weights(self, params, payload, *, rank, **kwargs):
        self._check(params, rank)
        super().load_weights(params, payload, rank=rank, **kwargs)

    def end_update(self, params, *, rank, **kwargs):
        self._check(params, rank)
        super().end_update(params, rank=rank, **kwargs)


class WakeLosesWeights(ReferenceImplementation):
    name = "wake_loses_weights"

    def sleep(self, params, *, level, **kwargs):
        super().sleep(params, level=2, **kwargs)  # "level 1" offloads nothing


class VersionSurvivesDiscard(ReferenceImplementation):
    name = "version_survives_discard"

    def wake_up(self, params, **kwargs):
        held = self._find_held(params)
        usable = held is not None and held.usable
        super().wake_up(params, **kwargs)
        if held is not None:
            held.usable = usable


class PartialAfterDiscard(ReferenceImplementation):
    name = "partial_after_discard"

    def end_update(self, params, **kwargs):
        try:
            super().end_update(params, **kwargs)
        except IncompleteUpdateError:  # "the rest is still there"
            held = self._find_held(params)
            held.completed += 1
            held.usable = True


class VersionMovesOnValueChange(ReferenceImplementation):
    name = "version_moves_on_value_change"

    def begin_update(self, params, **kwargs):
        super().begin_update(params, **kwargs)
        self._before = {n: t.clone() for n, t in params.items()}

    def end_update(self, params, **kwargs):
        super().end_update(params, **kwargs)
        if all(torch.equal(t, self._before[n]) for n, t in params.items()):
            self._find_held(params).completed -= 1  # "no value changed": not a new version


class StagedDoubleBeginFlushes(Staging):
    name = "staged_double_begin_flushes"

    def begin_update(self, params, **kwargs):
        entry = self._open.get(id(params))
        if entry is not None:  # "keep what the open update brought": written, then restarted
            self.write(params, entry[1])
        super().begin_update(params, **kwargs)


class VllmPublishesAtBegin(VllmRow):
    name = "vllm_publishes_at_begin"

    def begin_update(self, params, **kwargs):
        super().begin_update(params, **kwargs)
        held = self._find_held(params)
        held.completed += 1  # the new version is announced as the update opens
        held.usable = True

    def weight_version(self, params, **kwargs):
        held = self._find_held(params)
        return None if held is None or not held.usable else held.completed


class VllmSleepLosesParameter(VllmRow):
    name = "vllm_sleep_loses_parameter"

    def wake_up(self, params, *, spec, **kwargs):
        level = self._asleep.get(id(params), (None,))[0]
        super().wake_up(params, spec=spec, **kwargs)
        if level == 1:  # one parameter was never offloaded: it holds what the memory held
            with torch.no_grad():
                params[fused_name(spec.num_layers - 1, "w2")].fill_(float("nan"))


class VersionKeptWhileWriting(ReferenceImplementation):
    """Correct, not a mutant: an engine that writes every bucket in place and names the version
    it last completed until ``end_update`` completes the next one, as SGLang's
    ``weight_version`` label stays until the caller publishes a new one."""

    name = "version_kept_while_writing"

    def weight_version(self, params, **kwargs):
        held = self._find_held(params)
        if held is not None and self._find_open(params) is not None and held.completed:
            return held.completed  # "the update is not complete yet: still the last version"
        return super().weight_version(params, **kwargs)


class RefusedBeginWrites(StrictSessions):
    name = "refused_begin_writes"

    def begin_update(self, params, **kwargs):
        if self._find_open(params) is not None:
            with torch.no_grad():
                params[fused_name(0, "w2")].zero_()  # reset, then found the update active
        super().begin_update(params, **kwargs)


class Level2DiscardsRouter(ReferenceImplementation):
    name = "level2_discards_router"

    def sleep(self, params, *, level, **kwargs):
        super().sleep(params, level=level, **kwargs)
        if level == 2:  # every parameter discarded, the router weight too
            with torch.no_grad():
                params["model.layers.0.mlp.gate.weight"].fill_(float("nan"))


#: mutant -> (conformance test, its arguments but the implementation, the name it must get)
MUTANTS = {
    "publish_after_failed_chunk/refused_bucket": (
        PublishAfterFailedChunk, suite.test_a_failed_update_is_never_a_silent_mix,
        (CHECKPOINT, "refused_bucket"), "version published without a completed update"),
    "publish_after_failed_chunk/sender_exception": (
        PublishAfterFailedChunk, suite.test_a_failed_update_is_never_a_silent_mix,
        (TRTLLM, "sender_exception"), "version published without a completed update"),
    "publish_after_failed_chunk/version": (
        PublishAfterFailedChunk, suite.test_the_version_moves_once_per_completed_update,
        (CHECKPOINT,), "version published without a completed update"),
    "partial_advance/refused_bucket": (
        PartialAdvance, suite.test_a_failed_update_is_never_a_silent_mix,
        (CHECKPOINT, "refused_bucket"), "partial advance"),
    "partial_advance/sender_exception": (
        PartialAdvance, suite.test_a_failed_update_is_never_a_silent_mix,
        (TRTLLM, "sender_exception"), "partial advance"),
    "partial_advance/lost_rank": (
        PartialAdvance, suite.test_a_failed_update_is_never_a_silent_mix,
        (CHECKPOINT, "lost_rank"), "partial advance"),
    "post_load_before_writes": (
        PostLoadBeforeWrites, suite.test_identity_syncs_change_no_bit, (TRTLLM, "compat"),
        "post-load processing ran before the writes landed"),
    "identity_corrupts_fused": (
        IdentityCorruptsFused, suite.test_identity_syncs_change_no_bit, (CHECKPOINT, "packed"),
        "identity sync corrupted a fused parameter: model.layers.0.mlp.experts.w13_weight"),
    "replica_skipped/moe_tp": (
        ReplicaSkipped, suite.test_every_rank_and_replica_receives_the_update,
        (cases.REPLICA_CASES[0], lambda *_: None), "replica skipped"),
    "replica_skipped/moe_ep": (
        ReplicaSkipped, suite.test_every_rank_and_replica_receives_the_update,
        (cases.REPLICA_CASES[1], lambda *_: None), "replica skipped"),
    "one_session_per_rank": (
        OneSessionPerRank, suite.test_every_rank_and_replica_receives_the_update,
        (cases.REPLICA_CASES[0], lambda *_: None), "sessions interfere: r0:dp0:ep0:tp0=rank0"),
    "end_without_begin_reprocesses": (
        EndWithoutBeginReprocesses, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (TRTLLM, "end_without_begin"), "misuse corrupted the weights: an end_update without"),
    "version_per_bucket": (
        VersionPerBucket, suite.test_the_version_moves_once_per_completed_update, (CHECKPOINT,),
        "version published without a completed update"),
    "outside_session_keeps_version": (
        OutsideSessionKeepsVersion, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (CHECKPOINT, "outside_session"), "a bucket loaded outside a session changed layer 0"),
    "warns_on_reload": (
        WarnsOnReload, suite.test_identity_syncs_change_no_bit, (CHECKPOINT, "compat"),
        "identity sync 1 of 3"),
    "silent_mix/refused_bucket": (
        SilentMix, suite.test_a_failed_update_is_never_a_silent_mix, (CHECKPOINT,
                                                                       "refused_bucket"),
        "silent mix: end_update completed an update that failed"),
    "silent_mix/sender_exception": (
        SilentMix, suite.test_a_failed_update_is_never_a_silent_mix, (TRTLLM,
                                                                       "sender_exception"),
        "silent mix: end_update completed an update that failed"),
    "double_begin_ignored": (
        DoubleBeginIgnored, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (CHECKPOINT, "double_begin"), "a second begin_update was neither refused nor a restart"),
    "version_skips_identity": (
        VersionSkipsIdentity, suite.test_the_version_moves_once_per_completed_update,
        (CHECKPOINT,), "version did not move"),
    "version_bumped_twice": (
        VersionBumpedTwice, suite.test_the_version_moves_once_per_completed_update, (TRTLLM,),
        "version moved by 2, not once"),
    "stuck_after_failure": (
        StuckAfterFailure, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (TRTLLM, "begin_after_failure"), "stuck after a failed update"),
    "wake_loses_weights": (
        WakeLosesWeights, suite.test_sleep_and_wake_between_updates, (TRTLLM, 1),
        "weights lost across a level-1 sleep"),
    "version_survives_discard": (
        VersionSurvivesDiscard, suite.test_sleep_and_wake_between_updates, (CHECKPOINT, 2),
        "version survives a level-2 sleep"),
    "partial_after_discard": (
        PartialAfterDiscard, suite.test_sleep_and_wake_between_updates, (CHECKPOINT, 2),
        "partial update accepted after a level-2 sleep"),
    "version_moves_on_value_change": (
        VersionMovesOnValueChange, suite.test_the_version_moves_once_per_completed_update,
        (CHECKPOINT,), "version did not move"),
    "staged_double_begin_flushes": (
        StagedDoubleBeginFlushes, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (CHECKPOINT, "double_begin"),
        "silent mix at a second begin_update (accepted as a restart)"),
    "vllm_publishes_at_begin/ep": (
        VllmPublishesAtBegin, suite.test_the_version_moves_once_per_completed_update,
        (VLLM_EP,), "version published without a completed update"),
    "vllm_publishes_at_begin/tp": (
        VllmPublishesAtBegin, suite.test_the_version_moves_once_per_completed_update,
        (VLLM_TP,), "version published without a completed update"),
    "vllm_sleep_loses_parameter": (
        VllmSleepLosesParameter, suite.test_sleep_and_wake_between_updates, (VLLM_EP, 1),
        "weights lost across a level-1 sleep"),
    "refused_begin_writes": (
        RefusedBeginWrites, suite.test_misuse_of_the_session_is_refused_or_harmless,
        (VLLM_TP, "double_begin"), "misuse corrupted the weights: a refused second begin_update"),
    "level2_discards_router": (
        Level2DiscardsRouter, suite.test_sleep_and_wake_between_updates, (CHECKPOINT, 2),
        "level-2 sleep discarded what no update carries"),
}
#: mutant -> its correct twin, where it is not the unplanted reference.
TWINS = {
    "staged_double_begin_flushes": Staging,
    "vllm_publishes_at_begin/ep": VllmRow,
    "vllm_publishes_at_begin/tp": VllmRow,
    "vllm_sleep_loses_parameter": VllmRow,
    "refused_begin_writes": StrictSessions,
}
#: What else each mutant's message must say (the bug located, the engine pattern named).
ALSO = {
    "identity_corrupts_fused": ("gate/up halves swapped", "the forward on a fixed input changed",
                                "layer=0 expert=", "row=", "col="),
    "post_load_before_writes": ("raw checkpoint layout", "layer=0 expert="),
    "end_without_begin_reprocesses": ("post-load layout applied twice",),
    "replica_skipped/moe_tp": ("r0:dp1:", "still hold their bits from before it"),
    "replica_skipped/moe_ep": ("r0:dp1:", "still hold their bits from before it"),
    "partial_advance/refused_bucket": ("element(s) hold version 2",),
    "version_per_bucket": ("at bucket 0 of",),
    "version_skips_identity": ("an identity update",),
    "warns_on_reload": ("Failed to load weights",),
    "wake_loses_weights": ("layer=0 expert=",),
    "version_moves_on_value_change": ("an identity update", "no bit changed"),
    "staged_double_begin_flushes": ("weight_version still says 1",
                                    "element(s) hold version 2"),
    "vllm_publishes_at_begin/ep": ("at begin_update", "-R.tp1ep2dp1gu"),
    "vllm_publishes_at_begin/tp": ("at begin_update", "-R.tp4ep1dp1gu"),
    "vllm_sleep_loses_parameter": ("model.layers.1.mlp.experts.w2_weight", "layer=1 expert="),
    "level2_discards_router": ("model.layers.0.mlp.gate.weight",),
    "refused_begin_writes": ("model.layers.0.mlp.experts.w2_weight", "already active"),
}
