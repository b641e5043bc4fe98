"""Driving a distributed exporter in real trainer ranks, and the receivers with its streams.

In every rank (:func:`export_in_rank`, run through a warm rank pool): Megatron-Core's
``parallel_state`` is initialized for the case's trainer topology, the rank's real MoE layers
are built and filled with its synthetic shard values (only its own: the full weights are
dropped before the exporter runs), and the exporter is called once per update - one update
per payload format - with its inputs checked after each call
(:func:`pytest_weightsync.distributed.call_exporter`).

In the pytest process (:func:`judge`): the streams come back pickled; each one is loaded,
bucket by bucket between ``begin_update()`` and ``end_update()``, into a fresh reference
receiver of the engine rank it was sent to, and that rank is judged bit for bit against the
state computed independently from the synthetic value function. Colocated delivery feeds
``world // receiver.tp`` engine replicas; each is judged. Where SGLang imports, every stream
is also loaded, bucket by bucket (one ``load_weights`` call each, as
``update_weights_from_tensor`` does), by each stock SGLang row that claims its format and
receiver (:mod:`pytest_weightsync.reference_impl.backends.sglang_models`) and judged the same
way: a stream only the reference accepts is not one a real engine loads.
"""

from __future__ import annotations

import importlib.util

import pytest

from . import claims, judge, loader, reference
from .cases import DistCase
from pytest_weightsync.vocabulary import FORMATS

__all__ = ["DistCase", "FORMATS", "engine_loaders", "export_in_rank", "judge_streams",
           "require_megatron", "run_and_judge"]


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


def export_in_rank(exporter, dcase: DistCase, formats, version: int):
    """Rank body: real Megatron state for this rank, one exporter call per format. Returns
    one :class:`pytest_weightsync.distributed.RankExport` (or an error string) per format."""
    import torch.distributed as dist

    from pytest_weightsync import distributed
    from pytest_weightsync.reference_impl import synth, trainer
    from pytest_weightsync.reference_impl.megatron_state import (
        megatron_model_state,
        megatron_parallel_state,
        transformer_config,
    )

    case = dcase.case
    rank = dist.get_rank()
    with megatron_parallel_state(case.spec, case.trainer):
        full = synth.full_weights(case.spec, version)
        values = trainer.trainer_state(case.spec, case.trainer, rank, full)
        del full  # the trainer rank keeps only its own shards
        config = transformer_config(case.spec, case.trainer)
        _, params = megatron_model_state(case.spec, case.trainer, rank, values, config)
        out = []
        for update, fmt in enumerate(formats, start=1):
            try:
                out.append(distributed.call_exporter(
                    exporter, params, config=config, format=fmt, spec=case.spec,
                    trainer=case.trainer, receiver=case.receiver, delivery=dcase.delivery,
                    bucket_bytes=dcase.bucket_bytes, rank=rank, update=update))
            except distributed.DistributedExportError as error:
                out.append(str(error))  # reported by the pytest process, at this call
        return out


def _engine_streams(dcase: DistCase, rank_results: list) -> list:
    """``[(sender description, engine rank, stream)]`` in trainer-rank order."""
    out = []
    for result in rank_results:
        for engine_rank, stream in sorted(result.streams.items()):
            who = (f"trainer rank {result.trainer_rank} -> colocated engine replica "
                   f"{result.trainer_rank // dcase.case.receiver.tp} rank {engine_rank}"
                   if dcase.delivery == "colocated"
                   else f"trainer rank {result.trainer_rank} (sender) -> engine rank {engine_rank}")
            out.append((who, engine_rank, stream))
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


def _judge_with_engines(case, fmt: str, engine_rank: int, stream, version: int, head: str) -> None:
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
            judge.check_rank(params, case, engine_rank, version, before)
        except AssertionError as error:
            raise judge.ConformanceError(f"{head}, loaded by {engine.name}:\n{error}") from None
        except Exception as error:
            raise judge.ConformanceError(f"{head}: {engine.name} could not load the stream: "
                                         f"{judge.quoted(error)}") from None


def judge_streams(dcase: DistCase, fmt: str, rank_results: list, version: int) -> int:
    """Load every stream into a fresh reference receiver (and every claiming stock SGLang row)
    and check it bit for bit; raise :class:`suites.harness.judge.ConformanceError` naming the
    format, delivery, sender and engine rank. Returns the number of engine ranks checked."""
    errors = [r for r in rank_results if isinstance(r, str)]
    if errors:
        raise judge.ConformanceError(errors[0])
    case = dcase.case
    streams = _engine_streams(dcase, rank_results)
    wanted = case.receiver.tp * (dcase.world // case.receiver.tp
                                 if dcase.delivery == "colocated" else 1)
    if len(streams) != wanted:
        raise judge.ConformanceError(f"{fmt}/{dcase.delivery}: {len(streams)} streams came "
                                     f"back, expected {wanted}")
    for who, engine_rank, stream in streams:
        head = f"{fmt} payload, {dcase.delivery} delivery, {who}"
        reference.judge_stream(case, engine_rank, stream, fmt, version, head)
        _judge_with_engines(case, fmt, engine_rank, stream, version, head)
    return len(streams)


def run_and_judge(pool, exporter, dcase: DistCase, formats, version: int = 1) -> dict:
    """Export ``formats`` in the case's ranks and judge each; ``{format: engine ranks checked}``."""
    per_rank = pool.run(export_in_rank, dcase.world, exporter, dcase, tuple(formats), version)
    return {fmt: judge_streams(dcase, fmt, [r[i] for r in per_rank], version)
            for i, fmt in enumerate(formats)}
