"""Whole-model distributed exporters in real trainer ranks, and the judging of their streams.

In every rank (:func:`export_model_in_rank`, run through the warm rank pool of
:data:`WORLD` ranks): Megatron-Core's ``parallel_state`` for the case's trainer, the rank's
real ``GPTModel`` of the whole model (:mod:`pytest_weightsync.reference_impl.trainer.megatron_whole`:
every parameter filled with the oracle's shard of the synthetic checkpoint), then one exporter
call per update of :func:`suites.harness.distributed.plan_updates` - each update a new version
written IN PLACE into the same tensors, the first format again at the end - each call checked
in the rank for modified or rebound inputs (:func:`pytest_weightsync.distributed.call_exporter`).

In the pytest process (:func:`judge_update`): every stream is judged by the whole-model
coverage code (:func:`suites.harness.stream_coverage.judge_model_stream`): every tensor the
update owes carried exactly once in its dtype, then loaded into a fresh, fully poisoned
reference receiver and every engine parameter compared bit for bit (a value of the previous
update is "stale").
Where SGLang imports, every stock SGLang row that claims the model and format loads the first
update's streams too (:func:`judge_with_engines`), judged the same way.

One run serves every property of a case (:func:`run`, cached per implementation and case in
this process): the ranks are the expensive part, the properties read the same streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe

from . import coverage, judge, stream_coverage
from . import distributed as dh
from .cases import DeliveredCase
from .model_cases import ModelCase

#: Trainer ranks of every built-in case (one warm pool serves them all).
WORLD = 4


@dataclass(frozen=True)
class ModelDistCase(DeliveredCase):
    """A whole-model case exported from real trainer ranks: ``delivery``, the named bucket
    limit (``vocabulary.BUCKET_LIMITS``) the exporter is given, and the Megatron-Core layer
    spec the trainer is built from (``vocabulary.LAYER_SPECS``: ``te``, what real jobs build,
    unless a case says otherwise)."""

    case: ModelCase
    delivery: str
    bucket: str = "whole"
    layer_spec: str = "te"
    #: ``synced``: every version written whole, in place, before the exporter's call;
    #: ``after_step``: as a distributed-optimizer step leaves it with ``overlap_param_gather``
    #: (each DP rank's own shard fresh, the others stale until the param all-gather;
    #: ``reference_impl/trainer/param_sync.py``) - an exporter must complete that gather
    #: before it reads; ``relocated``: written, then every parameter moved to new storage (a
    #: trainer that offloads and reloads, or packs, its weights between refits) - an
    #: exporter must read the parameters it is given, not copies or views it kept.
    trainer_state: str = "synced"

    @property
    def bucket_bytes(self) -> Optional[int]:
        from .model_inputs import bucket_bytes

        return bucket_bytes(self.bucket, self.case.spec)

    @property
    def id(self) -> str:
        first = self.case.trainer.first_stage_layers
        uneven = f"-first{first}" if first else ""
        spec = "" if self.layer_spec == "te" else f"-{self.layer_spec}spec"
        state = {"synced": "", "after_step": "-afterstep"}.get(self.trainer_state,
                                                              f"-{self.trainer_state}")
        return f"{self.case.id}{uneven}-{self.delivery}-{self.bucket}{spec}{state}"


def _dcase(spec, receiver, trainer, delivery, bucket="whole", layer_spec="te",
           trainer_state="synced") -> ModelDistCase:
    return ModelDistCase(ModelCase(spec, receiver, trainer, spec.targets), delivery, bucket,
                         layer_spec, trainer_state)


#: The built-in cases, each in :data:`WORLD` ranks, over the topologies where whole-model
#: exports break: dense TP 2 (x EP 2 x ETP 2) with a float32 router and float32 expert bias;
#: PP 2 even with a
#: tied embedding on both stages (Qwen3.5: a GDN layer - its mixer modelled - on stage 0,
#: attention with the output gate on stage 1, shared experts, the MTP draft on stage 1;
#: engine TP 4 with fewer KV heads than ranks); PP 2 uneven (2 + 1 layers); EP 2 x ETP 2 with
#: TEGroupedMLP experts, tied, distributed delivery; then every other trainer topology of
#: the distributed expert matrix (``cases.DIST_CASES``, expert module included): TP 4 with
#: ETP 2 and EP 2 or 1, EP 4 with TP 1 and 2, PP 2 with an untied draft (its stage's own
#: embedding copy), TP x EP x PP, ETP x PP.
MODEL_DIST_CASES = (
    _dcase(qwen3_moe(num_kv_heads=2, router_dtype=torch.float32, expert_bias=True),
           ReceiverTopology(tp=2, moe_ep=2),
           TrainerTopology(tp=2, ep=2, etp=2, expert_impl="te_grouped"), "colocated",
           "split_layer"),
    _dcase(qwen3_5_moe(tied=True, linear_k_heads=4, linear_v_heads=8),
           ReceiverTopology(tp=4, moe_ep=2, order="up_gate"),
           TrainerTopology(tp=2, pp=2, expert_impl="te_grouped"), "distributed", "multi_layer"),
    _dcase(qwen3_moe(num_layers=3, num_kv_heads=2),
           ReceiverTopology(tp=2), TrainerTopology(ep=2, pp=2, first_stage_layers=2),
           "colocated"),
    _dcase(qwen3_moe(tied=True),
           ReceiverTopology(tp=1), TrainerTopology(ep=2, etp=2, expert_impl="te_grouped"),
           "distributed", "tensor"),
    # the remaining trainer topologies of the distributed expert matrix (cases.DIST_CASES):
    _dcase(qwen3_5_moe(),
           ReceiverTopology(tp=2, moe_ep=2), TrainerTopology(ep=2, etp=2),
           "colocated", "tensor"),
    _dcase(qwen3_moe(num_kv_heads=4, router_dtype=torch.float32, expert_bias=True),
           ReceiverTopology(tp=4), TrainerTopology(tp=4, ep=2, etp=2),
           "distributed", "split_layer"),
    _dcase(qwen3_moe(num_kv_heads=4),
           ReceiverTopology(tp=2, moe_ep=2), TrainerTopology(tp=4, etp=2, expert_impl="te_grouped"),
           "colocated", "multi_layer"),
    _dcase(qwen3_moe(num_experts=8),
           ReceiverTopology(tp=4, moe_ep=4), TrainerTopology(ep=4), "distributed"),
    _dcase(qwen3_5_moe(num_experts=8),
           ReceiverTopology(tp=1), TrainerTopology(tp=2, ep=4, expert_impl="te_grouped"),
           "distributed", "tensor"),
    # PP 2 with an untied MTP draft: its stage's own embedding copy (NeMo-RL#2471)
    _dcase(qwen3_5_moe(),
           ReceiverTopology(tp=2, order="up_gate"), TrainerTopology(ep=2, pp=2),
           "distributed", "split_layer"),
    _dcase(qwen3_moe(tied=True, num_kv_heads=2, router_dtype=torch.float32, expert_bias=True),
           ReceiverTopology(tp=2, moe_ep=2), TrainerTopology(tp=2, ep=2, pp=2),
           "colocated", "multi_layer"),
    # megatron-core's local spec (``input_layernorm.weight``, separate norms), kept for the
    # trainers that still build it
    _dcase(qwen3_moe(num_layers=4),
           ReceiverTopology(tp=2), TrainerTopology(etp=2, pp=2, expert_impl="te_grouped"),
           "colocated", layer_spec="local"),
    # the refit between the optimizer step and the deferred param all-gather (distributed
    # optimizer, overlap_param_gather; NeMo-RL#4086): dense parameters over DP 4
    _dcase(qwen3_moe(num_kv_heads=2),
           ReceiverTopology(tp=2), TrainerTopology(ep=2, etp=2, expert_impl="te_grouped"),
           "colocated", "split_layer", trainer_state="after_step"),
    # parameters moved to new storage after each step (Megatron-LM#7448: inference packing
    # relocated the storage a refit kept reading)
    _dcase(qwen3_moe(num_kv_heads=2),
           ReceiverTopology(tp=2), TrainerTopology(tp=2, ep=4, expert_impl="te_grouped"),
           "distributed", "tensor", trainer_state="relocated"),
)

#: Where each trainer state leaves the previous version, and what reads the new one (the
#: detail of a ``stale trainer shard`` finding).
STALE_COPIES = {
    "after_step": ("it lies in another DP rank's shard of the trainer's parameter buffer, not "
                   "gathered yet (distributed optimizer with overlap_param_gather: "
                   "start_param_sync(force_sync=True) on each model chunk before reading, "
                   "NeMo-RL#4086)"),
    "relocated": ("it was read from storage the parameter left after the step (the trainer "
                  "moved its parameters; read the tensors of model_state at each call, never "
                  "copies or views kept from an earlier one, Megatron-LM#7448)"),
}


def model_dist_params(cases=MODEL_DIST_CASES, where=None) -> list:
    """``pytest.param`` list of ``cases`` (those ``where(case)`` keeps), with readable ids."""
    import pytest

    return [pytest.param(c, id=c.id) for c in cases if where is None or where(c)]


def require_claim(impl, mcase: ModelDistCase, fmt=None) -> None:
    """Skip as not claimed unless ``impl`` claims the whole model, the trainer, the receiver
    and the delivery (and ``fmt``)."""
    from . import claims

    claims.require_model_claim(impl, "distributed_exporter", mcase.case, fmt)
    claims.require_claim(impl, "distributed_exporter", mcase.case, fmt, mcase.delivery)
    reason = impl.capabilities.layer_spec_refusal(mcase.layer_spec)
    if reason is not None:
        claims.skip_unclaimed(reason)


def export_model_in_rank(exporter, mcase: ModelDistCase, updates):
    """Rank body: the real whole model of this rank, one exporter call per ``(version,
    format)`` of ``updates``, each version written in place before its call. Returns one
    ``RankExport`` (or the error string of a broken contract) per update."""
    from pytest_weightsync.reference_impl.oracle import model_synth
    from pytest_weightsync.reference_impl.trainer import megatron_model, megatron_whole, param_sync

    case = mcase.case
    after_step = mcase.trainer_state == "after_step"
    built = []

    def modelled(version, rank):  # this rank's shard only: the checkpoint is dropped after it
        return megatron_model.trainer_model_state(case.spec, case.trainer, rank,
                                                  model_synth.full_model(case.spec, version))

    def build(rank, config, version):
        model, state = megatron_whole.whole_model_state(
            case.spec, case.trainer, rank, model_synth.full_model(case.spec, version), config,
            mcase.layer_spec, {"overlap_param_gather": True} if after_step else None)
        built[:] = [model]
        return model, state

    def write(state, rank, version):
        """The optimizer step; returns the state its deferred param gather would leave."""
        from pytest_weightsync.distributed import snapshot

        settled = []

        def step():
            megatron_whole.write_model(state, modelled(version, rank), rank)
            if after_step:
                settled.append(snapshot(state))
        if after_step:
            param_sync.step_with_deferred_gather(built[0], step)
            return settled[0]
        if mcase.trainer_state == "relocated":  # moved, then the step writes the new storage
            param_sync.relocate(state)
        step()
        return None

    try:
        return dh.export_from_trainer_rank(
            exporter, mcase, updates, case.spec.experts,
            configure=lambda: megatron_whole.transformer_config(case.spec, case.trainer),
            build=build, write=write)
    finally:
        built.clear()


@dataclass
class ModelDistRun:
    """Every update of one case: ``updates`` as planned, ``per_update[i]`` the rank results."""

    mcase: ModelDistCase
    updates: tuple
    per_update: list


_RUNS: dict = {}


def run(pool, exporter, mcase: ModelDistCase, formats) -> ModelDistRun:
    """The case's exports in real ranks (cached per implementation, case and formats for the
    session: every property of the case reads one run; the models are tiny)."""
    dh.require_megatron()
    key = (exporter.name, type(exporter).__qualname__, mcase, tuple(formats))
    if key not in _RUNS:
        updates = dh.plan_updates(formats)
        per_rank = pool.run(export_model_in_rank, mcase.world, exporter, mcase, updates)
        _RUNS[key] = ModelDistRun(mcase, updates,
                                  [[r[i] for r in per_rank] for i in range(len(updates))])
    return _RUNS[key]


def streams_of(result: ModelDistRun, index: int) -> list:
    """``[(sender description, engine rank, stream)]`` of update ``index`` (0-based)."""
    _, fmt = result.updates[index]
    return dh.delivered_streams(result.mcase, fmt, result.per_update[index])


def judge_update(result: ModelDistRun, index: int) -> int:
    """Judge every stream of update ``index`` (coverage, then every engine parameter after
    loading); raise naming the update, format, delivery, sender and engine rank. Returns the
    number of engine ranks judged."""
    version, fmt = result.updates[index]
    previous = result.updates[index - 1][0] if index else None
    streams = streams_of(result, index)
    for who, engine_rank, stream in streams:
        head = (f"update {index + 1} (version {version}), {fmt} payload, "
                f"{result.mcase.delivery} delivery, {who}")
        stream_coverage.judge_model_stream(
            result.mcase.case, engine_rank, stream, fmt, version, head,
            previous_version=previous, prop="coverage" if index == 0 else "model_bit_exact",
            stale_copies=STALE_COPIES.get(result.mcase.trainer_state))
        if index == 0:  # real engines load the first update; later ones are the reference's
            judge_with_engines(result.mcase.case, fmt, engine_rank, stream, version, head)
    return len(streams)


def judge_with_engines(case, fmt: str, engine_rank: int, stream, version: int, head: str,
                       previous_version=None) -> None:
    """Load ``stream`` into every stock SGLang row that claims this whole model and format (a
    real model class's ``load_weights`` over the engine's whole parameter tree, every tensor
    poisoned first) and judge every parameter as the reference receiver's: a stream only the
    reference accepts is not one a real engine loads."""
    from pytest_weightsync import compare

    from . import claims, model_inputs

    for engine in dh.engine_loaders():
        if claims.model_unclaimed(engine, "loader", case, fmt) is not None:
            continue
        params = model_inputs.engine_params(case, engine_rank)
        before = compare.snapshot(params)
        try:
            model_inputs.load_stream(engine, params, stream, fmt, case, engine_rank)
        except Exception as error:
            raise judge.ConformanceError(f"{head}: {engine.name} could not load the stream: "
                                         f"{judge.quoted(error)}") from None
        coverage.check_model_rank(params, case, engine_rank, version, before,
                                  previous_version=previous_version,
                                  head=f"{head}, loaded by {engine.name}: ")


def check_tied(result: ModelDistRun) -> None:
    """Every stream of every update carries the tied embedding from its one source."""
    for index, (_, fmt) in enumerate(result.updates):
        for who, engine_rank, stream in streams_of(result, index):
            problem = stream_coverage.tied_stream_problem(engine_rank, stream, fmt)
            if problem is not None:
                raise judge.ConformanceError(f"update {index + 1}, {who}: {problem}")


def check_draft(result: ModelDistRun) -> None:
    """Every stream of every update carries the whole draft (MTP) model the trainer holds."""
    for index, (version, fmt) in enumerate(result.updates):
        for who, engine_rank, stream in streams_of(result, index):
            problem = stream_coverage.draft_stream_problem(result.mcase.case, engine_rank,
                                                           stream, fmt, version)
            if problem is not None:
                raise judge.ConformanceError(f"update {index + 1}, {who}: {problem}")
