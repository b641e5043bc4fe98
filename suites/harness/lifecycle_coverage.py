"""``coverage_by_rank``: every engine rank of every engine replica holds the update.

Every engine rank of :data:`ENGINE_REPLICAS` engines (and every MoE-DP replica inside each,
where the topology has them) is updated with every session open at once and the buckets
interleaved; ranks holding the same shard are bit-identical; the ranks the check covered are
recorded (``replica:dp:ep:tp`` keys, as vLLM's weight checker returns them). On a vLLM engine
(no MoE-DP) the replicas are whole engine replicas (vLLM's data-parallel engines): the engines
this check feeds.
"""

from __future__ import annotations

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model.layout import receiver_shard
from pytest_weightsync.vocabulary import BUCKET_LIMITS

from . import judge
from .cases import ENGINE_REPLICAS
from .judge import ConformanceError
from .lifecycle_engine import EngineRank, attempt


def rank_key(case, replica: int, rank: int) -> str:
    """``replica:dp:ep:tp`` of an engine rank (vLLM's checker keys tensors ``dp:pp:pcp:tp:ep``)."""
    shard = receiver_shard(case.spec, case.receiver, rank)
    return (f"r{replica}:dp{shard.moe_dp_rank}:ep{shard.moe_ep_rank}:tp{shard.moe_tp_rank}"
            f"=rank{rank}")


def check_coverage(impl, case, fmt: str, record=None) -> str:
    """Every rank of :data:`ENGINE_REPLICAS` engines updated to version 1 with their buckets
    interleaved (every session open at once), judged against the oracle; ranks holding the
    same shard (MoE-DP replicas, engine replicas) bit-identical. Returns (and ``record`` s)
    the covered ranks."""
    world = case.receiver.world_size
    engines = [EngineRank(impl, case, rank, fmt)
               for _ in range(ENGINE_REPLICAS) for rank in range(world)]
    streams = [e.stream(1, bucket=BUCKET_LIMITS[i % len(BUCKET_LIMITS)])
               for i, e in enumerate(engines)]
    keys = [rank_key(case, i // world, e.rank) for i, e in enumerate(engines)]

    def step(i, what, call, *args):
        error = attempt(call, *args)
        if error is not None:
            raise ConformanceError(
                f"sessions interfere: {keys[i]} refused its {what} while the sessions of every "
                f"other rank and replica were open and their buckets interleaved (a loader "
                f"keeps one session per parameter set): {judge.quoted(error, 600)}")
    for i, engine in enumerate(engines):
        step(i, "begin_update", engine.begin)
    for index in range(max(map(len, streams))):
        for i, (engine, stream) in enumerate(zip(engines, streams)):
            if index < len(stream):
                step(i, f"bucket {index}", engine.load, stream[index])
    for i, engine in enumerate(engines):
        step(i, "end_update", engine.end)
    failures, covered = {}, []
    for i, engine in enumerate(engines):
        key = keys[i]
        try:
            engine.check(1)
            covered.append(key)
        except ConformanceError as error:
            failures[i] = (key, error)
    report = (f"{len(covered)} of {len(engines)} engine ranks ({ENGINE_REPLICAS} engines x "
              f"{world} ranks, moe_dp {case.receiver.moe_dp}) hold the update: "
              f"{', '.join(covered) or 'none'}")
    if record is not None:
        record(report)
    groups: dict = {}
    for i, engine in enumerate(engines):
        shard = receiver_shard(case.spec, case.receiver, engine.rank)
        groups.setdefault((shard.moe_ep_rank, shard.moe_tp_rank), []).append(i)
    for members in groups.values():
        ref = members[0]
        for other in members[1:]:
            a, b = engines[ref], engines[other]
            differ = [n for n in a.params if not compare.same_bits(a.params[n], b.params[n])]
            if differ:
                raise _replica_failure(case, engines, failures, ref, other, differ, report)
    if failures:
        i, (key, error) = next(iter(failures.items()))
        raise ConformanceError(f"rank not covered: {key} did not receive the update - "
                               f"{report}\n{error}", error.mismatch)
    return report


def _replica_failure(case, engines, failures, ref, other, differ, report) -> ConformanceError:
    world = case.receiver.world_size
    a, b = engines[ref], engines[other]
    # name the one that still holds what it held before the update, if one does
    for lagging, peer in ((other, ref), (ref, other)):
        e = engines[lagging]
        stale = [n for n in differ if compare.same_bits(e.params[n], e.poisoned.records[n].copy)]
        if stale and lagging in failures and peer not in failures:
            key, error = failures[lagging]
            holder = rank_key(case, peer // world, engines[peer].rank)
            return ConformanceError(
                f"replica skipped: {key} never received the update - {stale[:2]} still hold "
                f"their bits from before it, while {holder} of the same shard holds it; every "
                f"replica must be written - {report}\n{error}", error.mismatch)
    first = failures.get(other) or failures.get(ref)
    return ConformanceError(
        f"replicas differ: {rank_key(case, ref // world, a.rank)} and "
        f"{rank_key(case, other // world, b.rank)} hold the same shard but {differ[:3]} differ "
        f"- {report}" + (f"\n{first[1]}" if first else ""),
        first[1].mismatch if first else None)
