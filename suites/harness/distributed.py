"""Driving a distributed exporter in real trainer ranks, and the receivers with its streams.

In every rank (:func:`export_in_rank`, run through a warm rank pool): Megatron-Core's
``parallel_state`` is initialized for the case's trainer topology, the rank's model is built
as ``megatron.training.get_model`` builds it (:mod:`pytest_weightsync.reference_impl.
megatron_state`: DDP-wrapped ``GPTModel`` chunks, real ``TransformerLayer`` s) and its expert
weights are filled with the rank's synthetic shard values (only its own: the full weights are
dropped before the exporter runs). Then the exporter is called once per update
(:func:`plan_updates`): every claimed format, each update a new version written IN PLACE into
the same parameters between calls (as an optimizer step does), and the first format once more
at the end - so an exporter that caches its first call's tensors returns stale values. After
each call its inputs are checked: values and storage
(:func:`pytest_weightsync.distributed.call_exporter`).

In the pytest process (:func:`judge_streams`): the streams come back pickled; each one is loaded,
bucket by bucket between ``begin_update()`` and ``end_update()``, into a fresh reference
receiver of the engine rank it was sent to, and that rank is judged bit for bit against the
state computed independently from the synthetic value function (a result equal to the
previous update's values is named "stale"; a gathered tensor of the wrong intermediate size
names the group it was gathered over). Colocated delivery feeds ``world // receiver.tp``
engine replicas; each is judged. Where SGLang imports, every stream is also loaded, bucket by
bucket (one ``load_weights`` call each, as ``update_weights_from_tensor`` does), by each stock
SGLang row that claims its format and receiver
(:mod:`pytest_weightsync.reference_impl.backends.sglang_models`) and judged the same way: a
stream only the reference accepts is not one a real engine loads. Buckets that exceed
``bucket_bytes`` by more than one unit come back as findings (:class:`DistResult`), recorded
by the suite, never a value failure.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import pytest

from . import claims, judge, loader, reference
from .cases import DistCase
from pytest_weightsync.reference_impl.senders.buckets import bucket_limit_findings
from pytest_weightsync.ranks import launch
from pytest_weightsync.vocabulary import FORMATS

#: Every rank of the Megatron suites imports megatron-core (5 s of CPU): once in the fork
#: server that gloo ranks are forked from, not once per rank start.
launch.want_preloaded("megatron.core")

__all__ = ["DistCase", "DistResult", "FORMATS", "delivered_streams", "engine_loaders",
           "engine_streams", "export_in_rank",
           "gather_group_diagnosis", "judge_streams", "plan_updates", "require_megatron",
           "run_and_judge"]


def require_megatron() -> None:
    """Skip, naming the package, unless megatron-core can be imported (checked cheaply)."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed: distributed exporters run against real "
                    "megatron.core.parallel_state groups and MoE layers (pip install "
                    "'pytest-weightsync[megatron]')")


def require_claim(impl, dcase: DistCase, fmt=None) -> None:
    """Skip as not claimed unless ``impl`` claims the receiver, trainer and delivery; skip as
    not applicable when colocated delivery cannot feed this engine."""
    claims.require_claim(impl, "distributed_exporter", dcase.case, fmt, dcase.delivery)
    if dcase.delivery == "colocated" and dcase.world % dcase.case.receiver.tp:
        claims.skip_not_applicable(
            f"colocated delivery needs the trainer world ({dcase.world}) to be a multiple of "
            f"the engine size ({dcase.case.receiver.tp})")


def plan_updates(formats) -> tuple:
    """``((version, format), ...)``: version 1, 2, ... one per claimed format, then the first
    format again - at least two versions per case, and the parameters change between any two
    consecutive calls."""
    formats = tuple(formats)
    return tuple((i + 1, fmt) for i, fmt in enumerate(formats + formats[:1]))


def export_in_rank(exporter, dcase: DistCase, updates):
    """Rank body: real Megatron model for this rank, one exporter call per ``(version,
    format)`` of ``updates``, the shard values of each version written in place before its
    call. Returns one :class:`pytest_weightsync.distributed.RankExport` (or an error string)
    per update."""
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer
    from pytest_weightsync.reference_impl.trainer.megatron_state import (
        megatron_model_state,
        transformer_config,
        write_shards,
    )

    case = dcase.case

    def shard_values(version, rank):  # only its own
        return trainer.trainer_state(case.spec, case.trainer, rank,
                                     synth.full_weights(case.spec, version))

    return export_from_trainer_rank(
        exporter, dcase, updates, case.spec,
        configure=lambda: transformer_config(case.spec, case.trainer),
        build=lambda rank, config, version: megatron_model_state(
            case.spec, case.trainer, rank, shard_values(version, rank), config),
        write=lambda params, rank, version: write_shards(params, shard_values(version, rank),
                                                         rank))


def export_from_trainer_rank(exporter, dcase, updates, parallel_spec, *, configure, build,
                             write) -> list:
    """The rank body both distributed suites run, inside megatron-core's parallel state of
    ``parallel_spec`` and the case's trainer: ``configure()`` the model config, ``build(rank,
    config, version)`` the real model and its tensors at the first version, then
    :func:`call_each_update` with ``write(tensors, rank, version)`` as the optimizer step. The
    model is dropped before the parallel state (and its groups) goes."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.megatron_state import megatron_parallel_state

    from megatron.core import parallel_state as ps

    case, rank = dcase.case, dist.get_rank()
    with megatron_parallel_state(parallel_spec, case.trainer):
        # a pipeline stage's source rank (slime's pp source: TP rank 0 of DP rank 0) gets an
        # engine channel of its own under distributed delivery
        source_rank = ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_data_parallel_rank(with_context_parallel=True) == 0
        config = configure()
        model, tensors = build(rank, config, updates[0][0])
        try:
            return call_each_update(
                exporter, tensors, updates, lambda version: write(tensors, rank, version),
                config=config, spec=case.spec, trainer=case.trainer, receiver=case.receiver,
                delivery=dcase.delivery, bucket_bytes=dcase.bucket_bytes, rank=rank, model=model,
                source_rank=source_rank)
        finally:
            del model, tensors


def call_each_update(exporter, state, updates, write_version, **call) -> list:
    """Rank body part: one exporter call per ``(version, format)`` of ``updates`` on the
    rank's real tensors ``state`` (already holding the first version), each later version
    written in place first (``write_version(version)``: an optimizer step; what it returns,
    a snapshot of the state once the step's deferred work completes or ``None``, is
    ``call_exporter``'s ``settled``). Returns one
    ``RankExport`` per call, or the error string of a broken contract (reported by the pytest
    process, at that call)."""
    from pytest_weightsync import distributed

    out, current, settled = [], updates[0][0], None
    for update, (version, fmt) in enumerate(updates, start=1):
        if version != current:
            settled = write_version(version)
            current = version
        try:
            out.append(distributed.call_exporter(exporter, state, format=fmt, update=update,
                                                 settled=settled, **call))
        except distributed.DistributedExportError as error:
            out.append(str(error))
    return out


def engine_streams(dcase, rank_results: list) -> list:
    """``[(sender description, engine rank, stream)]``, one per engine rank (of every colocated
    replica), in engine order (``dcase``: any case with ``case.receiver``, ``delivery`` and
    ``world``, expert-only or whole-model). What several trainer ranks sent one engine rank is
    joined in trainer-rank order: the pipeline stages' source ranks each broadcasting their
    stage, a colocated replica's gather source serializing for every engine rank of it. An
    engine rank nobody sent anything gets an empty stream (judged: never written)."""
    tp = dcase.case.receiver.tp
    colocated = dcase.delivery == "colocated"
    replicas = dcase.world // tp if colocated else 1
    joined = {(k, e): [] for k in range(replicas) for e in range(tp)}
    for result in rank_results:
        replica = result.trainer_rank // tp if colocated else 0
        for engine_rank, stream in sorted(result.streams.items()):
            joined.setdefault((replica, engine_rank), []).append((result, stream))
    out = []
    for (replica, engine_rank), parts in sorted(joined.items()):
        sent = [(r, s) for r, s in parts if s]
        senders = sent or parts[:1]
        if colocated:
            own = replica * tp + engine_rank
            if not sent:
                who = f"trainer rank {own} (nothing from this rank)"
            elif len(senders) == 1:
                who = f"trainer rank {senders[0][0].trainer_rank}"
            else:
                who = "trainer ranks " + " + ".join(str(r.trainer_rank) for r, _ in senders)
            who += f" -> colocated engine replica {replica} rank {engine_rank}"
        elif len(senders) > 1:
            who = ("trainer ranks " + " + ".join(str(r.trainer_rank) for r, _ in senders) +
                   f" (senders, joined) -> engine rank {engine_rank}")
        elif senders:
            who = f"trainer rank {senders[0][0].trainer_rank} (sender) -> engine rank {engine_rank}"
        else:
            who = f"no trainer rank (sender) -> engine rank {engine_rank}"
        transports = set().union(*(r.transports for r, _ in senders)) if senders else set()
        if transports:  # the wire formats it travelled on, where not plain tensors
            who += f", sent as {' + '.join(sorted(transports))}"
        out.append((who, engine_rank, [bucket for _, s in senders for bucket in s]))
    return out


_ENGINE_LOADERS = None


def engine_loaders() -> list:
    """The stock SGLang rows available here (none when SGLang does not import, or when
    ``WEIGHTSYNC_OPTIONAL_BUILTINS`` leaves them out), built once per process."""
    global _ENGINE_LOADERS
    if _ENGINE_LOADERS is None:
        from pytest_weightsync.registry import as_implementation, optional_targets

        _ENGINE_LOADERS = [as_implementation(target, source)
                           for target, source in optional_targets()]
    return _ENGINE_LOADERS


def _judge_with_engines(case, fmt: str, engine_rank: int, stream, version: int, head: str,
                        previous_version=None) -> None:
    """Load ``stream`` into every claiming stock SGLang row over fresh harness buffers and
    judge the result like the reference receiver's: a stream only the reference accepts is
    not one a real engine loads."""
    from pytest_weightsync import compare

    from . import inputs

    for engine in engine_loaders():
        if claims.unclaimed(engine, "loader", case, fmt) is not None:
            continue
        params = inputs.receiver_params(case, engine_rank)
        before = compare.snapshot(params)
        try:
            loader.load_stream(engine, params, stream, fmt, case, engine_rank, framed=False)
            judge.check_rank(params, case, engine_rank, version, before,
                             previous_version=previous_version, side="exporter")
        except AssertionError as error:
            raise judge.ConformanceError(f"{head}, loaded by {engine.name}:\n{error}") from None
        except Exception as error:
            raise judge.ConformanceError(f"{head}: {engine.name} could not load the stream: "
                                         f"{judge.quoted(error)}") from None


#: Where the intermediate (ETP-sharded) size sits in each entry of each format, by projection.
_INTERMEDIATE_DIM = {"gate": 0, "up": 0, "down": 1, "w13": 1, "w2": 2, "gate_up": 1}


def _expected_shape(case, fmt: str, engine_rank: int, parsed):
    from pytest_weightsync.reference_impl.model.layout import packed_shape, receiver_param_shapes

    spec = case.spec
    if parsed.kind == "expert":
        return spec.hf_shape(parsed.projection)
    if parsed.kind == "hf_fused":
        return packed_shape(spec, "w13" if parsed.projection == "gate_up" else "w2")
    if fmt == "direct":
        return receiver_param_shapes(spec, case.receiver, engine_rank).get(
            f"model.layers.{parsed.layer}.mlp.experts.{parsed.projection}_weight")
    return packed_shape(spec, parsed.projection)


def gather_group_diagnosis(case, fmt: str, engine_rank: int, stream):
    """A one-line name for a stream whose expert tensors have the wrong intermediate size by
    the factor of a wrong gather group (the dense TP group instead of the expert TP group, or
    no ETP gather at all), else ``None``."""
    from fractions import Fraction

    from pytest_weightsync.reference_impl.model.layout import parse_receiver_name

    trainer = case.trainer
    for bucket in stream:
        for name, tensor in bucket:
            parsed = parse_receiver_name(name)
            shape = tuple(getattr(tensor, "shape", ()))
            if parsed is None or parsed.projection not in _INTERMEDIATE_DIM:
                continue
            expected = _expected_shape(case, fmt, engine_rank, parsed)
            dim = _INTERMEDIATE_DIM[parsed.projection]
            if expected is None or len(shape) != len(expected) or shape == tuple(expected):
                continue
            what = f"{name} is {shape}, expected {tuple(expected)}"
            others = [i for i, (a, b) in enumerate(zip(shape, expected)) if i != dim and a != b]
            if len(others) == 1 and trainer.etp > 1 and \
                    shape[others[0]] == expected[others[0]] * trainer.etp and \
                    shape[dim] * trainer.etp == expected[dim]:
                return (f"ETP shards joined along the wrong dim: {what} - the {trainer.etp} "
                        f"shards of the intermediate dim ({dim}) were concatenated along dim "
                        f"{others[0]} (e.g. trusting partition_dim=0 that Transformer Engine "
                        f"reports for linear_fc2 under explicit expert comms)")
            if others:
                continue
            group = Fraction(shape[dim], expected[dim]) * trainer.etp
            if group.denominator != 1:
                continue
            if group == 1:
                return (f"not gathered over the expert tensor-parallel group: {what} - one "
                        f"rank's ETP shard (ETP size {trainer.etp})")
            if group == trainer.tp:
                return (f"gathered over the dense tensor-parallel group (size {trainer.tp}) "
                        f"instead of the expert tensor-parallel group (size {trainer.etp}): "
                        f"{what}")
            return (f"gathered over a group of {int(group)} ranks instead of the expert "
                    f"tensor-parallel group (size {trainer.etp}): {what}")
    return None


def delivered_streams(dcase, fmt: str, rank_results: list) -> list:
    """:func:`engine_streams` of one update, after the ranks' own findings (the first is
    raised) and a check that the delivery fed every engine rank (of every colocated replica)."""
    errors = [r for r in rank_results if isinstance(r, str)]
    if errors:
        raise judge.ConformanceError(errors[0])
    streams = engine_streams(dcase, rank_results)
    tp = dcase.case.receiver.tp
    wanted = tp * (dcase.world // tp if dcase.delivery == "colocated" else 1)
    if len(streams) != wanted:
        raise judge.ConformanceError(f"{fmt}/{dcase.delivery}: {len(streams)} streams came "
                                     f"back, expected {wanted}")
    return streams


def judge_streams(dcase: DistCase, fmt: str, rank_results: list, version: int,
                  previous_version=None) -> int:
    """Load every stream into a fresh reference receiver (and every claiming stock SGLang row)
    and check it bit for bit; raise :class:`suites.harness.judge.ConformanceError` naming the
    format, delivery, sender and engine rank. Returns the number of engine ranks checked."""
    case = dcase.case
    streams = delivered_streams(dcase, fmt, rank_results)
    for who, engine_rank, stream in streams:
        head = f"{fmt} payload, {dcase.delivery} delivery, {who}"
        try:
            reference.judge_stream(case, engine_rank, stream, fmt, version, head,
                                   previous_version=previous_version)
        except judge.ConformanceError as error:
            hint = gather_group_diagnosis(case, fmt, engine_rank, stream)
            if hint is None:
                raise
            text = str(error)
            if text.startswith(head):
                text = text[len(head):].lstrip(":").lstrip()
            raise judge.ConformanceError(f"{head}:\n{hint}\n{text}", error.mismatch) from None
        _judge_with_engines(case, fmt, engine_rank, stream, version, head, previous_version)
    return len(streams)


@dataclass
class DistResult:
    """What one distributed case produced: ``checked`` maps each ``(update, version, format)``
    to the engine ranks judged; ``bucket_findings`` lists every bucket (any update, any rank)
    that exceeds ``bucket_bytes`` by more than one unit; ``transports`` the wire formats the
    buckets travelled on (:data:`pytest_weightsync.vocabulary.TRANSPORTS`)."""

    checked: dict = field(default_factory=dict)
    bucket_findings: list = field(default_factory=list)
    transports: set = field(default_factory=set)

    @property
    def formats(self) -> set:
        return {fmt for _, _, fmt in self.checked}


def record_bucket_limit(record_property, dcase: DistCase, result: DistResult) -> None:
    """Record the case's bucket-limit finding (``weightsync_bucket_limit``: ``within`` or
    ``over``, ``weightsync_bucket_limit_detail``: the first offending bucket); nothing when
    the case sets no limit."""
    from pytest_weightsync.vocabulary import BUCKET_OVER, BUCKET_WITHIN

    if dcase.bucket_bytes is None:
        return
    over = result.bucket_findings
    record_property("weightsync_bucket_limit", BUCKET_OVER if over else BUCKET_WITHIN)
    record_property("weightsync_bucket_limit_detail",
                    f"{len(over)} buckets over; first: {over[0]}" if over else "")


def run_and_judge(pool, exporter, dcase: DistCase, formats) -> DistResult:
    """Export every update of :func:`plan_updates` in the case's ranks and judge each, in
    order (the first wrong update fails)."""
    updates = plan_updates(formats)
    per_rank = pool.run(export_in_rank, dcase.world, exporter, dcase, updates)
    result = DistResult()
    for i, (version, fmt) in enumerate(updates):
        rank_results = [r[i] for r in per_rank]
        previous = updates[i - 1][0] if i else None
        result.checked[i + 1, version, fmt] = judge_streams(dcase, fmt, rank_results, version,
                                                            previous)
        for r in rank_results:
            if any(r.streams.values()):  # a rank that sent something: pairs unless it said otherwise
                result.transports |= r.transports or {"tensors"}
        result.bucket_findings += [
            line for who, _, stream in engine_streams(dcase, rank_results)
            for line in bucket_limit_findings(stream, dcase.bucket_bytes,
                                              f"update {i + 1} ({fmt}), {who}")]
    return result
