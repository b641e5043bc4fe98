"""The reference distributed exporter: what runs in every trainer rank of a real Megatron job.

It reads what a real trainer holds - this rank's ``named_parameters()`` of a (DDP-wrapped)
Megatron model, local layer and expert numbering, SequentialMLP or TEGroupedMLP spelling - and
the process groups of ``megatron.core.parallel_state``, then:

1. stacks its local expert shards (``fc1 = [gate_r; up_r]``, ``fc2 = down[:, cols_r]``); where
   those stacks are exactly the direct parameters of the engine rank this rank feeds
   (colocated, trainer ETP == engine MoE-TP, the same experts, every layer:
   :func:`shards_are_engine_params`), it sends them as they are and gathers nothing;
2. all_gathers over the EP/ETP/PP groups of ``parallel_state`` and regroups fc1 into gate and
   up, joins fc2 along its partition dim, offsets expert ids by EP rank and layers by PP stage
   (:func:`pytest_weightsync.reference_impl.trainer.trainer.gather_stacked`);
3. builds the payload in the requested format for the engine rank(s) it feeds and cuts it
   into buckets (:func:`pytest_weightsync.reference_impl.senders.buckets.split_buckets`).

Delivery (see :mod:`pytest_weightsync.protocols`): ``colocated`` returns one stream for the
engine rank colocated with this trainer rank; ``distributed`` returns every engine rank's
stream from trainer rank 0 and ``None`` elsewhere.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from pytest_weightsync.protocols import colocated_engine_rank
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    WeightSyncError,
    parse_megatron_name,
)

#: Everything up to and including the model wrappers' prefixes (``module.module.``, ...).
_DECODER = re.compile(r"^(?:.*?\.)?(decoder\..*)$")


class ModelStateError(WeightSyncError):
    """The model state lacks an expert parameter, or holds one twice or of the wrong shape."""


def local_expert_stacks(spec: MoESpec, model_state: Mapping, rows: int):
    """``(fc1 [L_stage, e_local, 2*rows, H], fc2 [L_stage, e_local, H, rows])`` from this
    rank's named parameters (either expert spelling, any wrapper prefix)."""
    import torch

    found = {}
    for name, param in model_state.items():
        m = _DECODER.match(name)
        parsed = parse_megatron_name(m.group(1)) if m else None
        if parsed is None:
            continue
        if parsed in found:
            raise ModelStateError(f"two parameters for local (layer, expert, fc) {parsed}: "
                                  f"{found[parsed][0]!r} and {name!r}")
        found[parsed] = (name, param)
    if not found:
        raise ModelStateError("the model state holds no Megatron expert parameter "
                              "(decoder.layers.L.mlp.experts...linear_fc1/2.weight)")
    n_layers = 1 + max(k[0] for k in found)
    n_experts = 1 + max(k[1] for k in found)
    shapes = {1: (2 * rows, spec.hidden), 2: (spec.hidden, rows)}
    stacks = {}
    for fc in (1, 2):
        per_layer = []
        for li in range(n_layers):
            row = []
            for ei in range(n_experts):
                if (li, ei, fc) not in found:
                    raise ModelStateError(f"no linear_fc{fc} weight for local layer {li}, "
                                          f"local expert {ei}")
                name, param = found[li, ei, fc]
                if tuple(param.shape) != shapes[fc]:
                    raise ModelStateError(f"{name}: shape {tuple(param.shape)}, expected "
                                          f"{shapes[fc]}")
                row.append(param.detach())
            per_layer.append(torch.stack(row))
        stacks[fc] = torch.stack(per_layer)
    return stacks[1], stacks[2]


def shards_are_engine_params(spec: MoESpec, trainer, receiver) -> bool:
    """Whether every trainer rank's expert shards are, layer for layer, exactly the direct
    parameters of the engine rank it feeds under colocated delivery (``trainer_rank %
    engine_tp``): every layer on every rank (PP 1), the same experts in the engine's slots,
    the same intermediate rows and no padding (trainer ETP == engine MoE-TP, Megatron's
    ``[gate_r; up_r]`` being SGLang's ``w13`` rows), gate first, parameters held as checkpoint
    tensors (no transposed or fp8 engine layout).

    Then direct needs no gather - Relax's TP-local direct loading, without even the
    all_gather. Decided from the two topologies alone, so every rank decides alike: either
    all of them skip the collective gather or none does."""
    from pytest_weightsync.reference_impl.model.layout import receiver_shard, trainer_shard

    if (receiver.order != "gate_up" or receiver.engine_layout != "checkpoint"
            or receiver.weight_quant != "none"):
        return False
    layers = list(range(spec.num_layers))
    for rank in range(trainer.world_size):
        mine = trainer_shard(spec, trainer, rank)
        theirs = receiver_shard(spec, receiver, colocated_engine_rank(rank, receiver.tp))
        if (list(mine.layers) != layers or theirs.buffer_rows != theirs.rows
                or (mine.row_start, mine.rows) != (theirs.row_start, theirs.rows)):
            return False
        if any(list(theirs.slot_experts(layer)) != list(mine.experts) for layer in layers):
            return False
    return True


def local_direct_payload(spec: MoESpec, model_state: Mapping, trainer) -> list:
    """This rank's direct payload from its own expert shards, no gather (where
    :func:`shards_are_engine_params`): per layer its fc1 stack ``[E_local, 2*rows, H]``
    (``[gate_r; up_r]`` per expert) as ``w13_weight`` and its fc2 stack ``[E_local, H, rows]``
    as ``w2_weight``, ``E_local`` and ``rows`` what the ``trainer`` topology gives each rank.
    A state short of a layer or an expert is refused before anything is sent."""
    from pytest_weightsync.reference_impl.model.layout import fused_name

    experts = spec.num_experts // trainer.ep
    fc1, fc2 = local_expert_stacks(spec, model_state, spec.intermediate // trainer.etp)
    if tuple(fc1.shape[:2]) != (spec.num_layers, experts):
        raise ModelStateError(f"the model state holds {fc1.shape[1]} local experts in "
                              f"{fc1.shape[0]} layers; this rank holds {experts} in each of "
                              f"{spec.num_layers}")
    out = []
    for layer in range(spec.num_layers):
        out += [(fused_name(layer, "w13"), fc1[layer]), (fused_name(layer, "w2"), fc2[layer])]
    return out


#: ``gather_full(..., pp=NO_PP_GATHER)``: gather experts within the stage only.
NO_PP_GATHER = "stage"


def gather_full(spec: MoESpec, model_state: Mapping, *, etp=None, ep=None, pp=None):
    """Full HF expert weights of every layer (``{layer: (ExpertWeights, ...)}``) from this
    rank's named parameters, gathered over the ETP / EP / PP groups of Megatron's
    ``parallel_state`` (or the groups given; ``pp=NO_PP_GATHER``: this stage's layers only,
    stage-local index). Collective over the trainer world."""
    from megatron.core import parallel_state as ps

    from pytest_weightsync.reference_impl.trainer.trainer import gather_stacked

    etp_size = ps.get_expert_tensor_parallel_world_size()
    if spec.intermediate % etp_size:
        raise WeightSyncError(f"intermediate {spec.intermediate} is not divisible by the "
                              f"expert tensor parallel size {etp_size}")
    fc1, fc2 = local_expert_stacks(spec, model_state, spec.intermediate // etp_size)
    return gather_stacked(spec, fc1, fc2,
                          etp=ps.get_expert_tensor_parallel_group() if etp is None else etp,
                          ep=ps.get_expert_model_parallel_group() if ep is None else ep,
                          pp=(ps.get_pipeline_model_parallel_group() if pp is None else
                              None if pp == NO_PP_GATHER else pp))


def wire_transport(transport: str) -> tuple:
    """``(transport, options)`` of one of :data:`REFERENCE_TRANSPORTS`: a registered transport
    (:mod:`pytest_weightsync.transports`), ``_flattened`` asking it for one flat buffer per
    bucket."""
    from pytest_weightsync import transports

    name, flattened = (transport[:-len("_flattened")], True) \
        if transport.endswith("_flattened") else (transport, False)
    return transports.get(name), ({"flattened": True} if flattened else {})


def encoded(stream: list, transport: str, *, engine_rank: int, engine_tp: int) -> list:
    """``stream`` (buckets of ``(name, tensor)``) for ``engine_rank`` on the wire ``transport``,
    encoded by the transport itself (a serialized update holds the bucket in ``engine_rank``'s
    entry, the other ranks' entries empty: each stream is one engine rank's)."""
    wire, options = wire_transport(transport)
    return wire.encode(stream, engine_rank=engine_rank, engine_tp=engine_tp, **options)


#: Formats whose payload is the same for every engine rank: the only ones a broadcast to all
#: of them can carry (a ``direct`` payload is each rank's own slice).
BROADCAST_FORMATS = ("compat", "hf_fused", "packed")


def engine_streams(full, *, format, spec, receiver, delivery, bucket_bytes: Optional[int],
                   export=None, transport: str = "tensors", engine=None):
    """What this trainer rank returns for ``delivery`` (see the module docstring) from the
    full weights: one stream for its colocated engine rank, or every engine rank's stream
    from rank 0 (``None`` elsewhere), on ``transport``. ``export(format, spec, receiver,
    engine_rank, full)`` builds one engine rank's payload (default: the expert senders';
    whole models pass :func:`pytest_weightsync.reference_impl.senders.model_senders.export`).
    ``transport="broadcast"`` (distributed delivery, given the ``engine``) broadcasts instead
    of returning, for the formats of :data:`BROADCAST_FORMATS`; ``broadcast_flattened``
    broadcasts one buffer per bucket."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.senders import formats as senders
    from pytest_weightsync.reference_impl.senders.buckets import split_buckets

    export = senders.export if export is None else export
    rank = dist.get_rank()

    def stream_for(engine_rank):
        return split_buckets(export(format, spec, receiver, engine_rank, full), bucket_bytes)

    wire, options = wire_transport(transport)
    if wire.channel:  # sent on the engine channel where there is one; else as pairs
        transport = "tensors"
    if delivery == "colocated":  # nobody to broadcast to: every rank feeds its own engine rank
        engine_rank = colocated_engine_rank(rank, receiver.tp)
        return encoded(stream_for(engine_rank), transport, engine_rank=engine_rank,
                       engine_tp=receiver.tp)
    if delivery == "distributed":
        if rank != 0:
            return None
        if wire.channel and engine is not None and format in BROADCAST_FORMATS:
            wire.encode(stream_for(0), engine_rank=0, engine_tp=receiver.tp, engine=engine,
                        **options)
            return None
        return {r: encoded(stream_for(r), transport, engine_rank=r, engine_tp=receiver.tp)
                for r in range(receiver.tp)}
    raise WeightSyncError(f"unknown delivery {delivery!r}; expected 'colocated' or 'distributed'")


#: The ways the reference puts its buckets on the builtin transports (:func:`engine_streams`;
#: any transport registered under ``weightsync.transports`` is sent on as well).
REFERENCE_TRANSPORTS = ("tensors", "flattened_bucket", "serialized", "serialized_flattened",
                        "broadcast", "broadcast_flattened")


def export_weights_distributed(model_state, *, config, format, spec, trainer, receiver,
                               delivery, bucket_bytes: Optional[int], transport: str = "tensors",
                               engine=None):
    """See the module docstring. Collective over every rank of the trainer world."""
    if delivery not in ("colocated", "distributed"):
        raise WeightSyncError(f"unknown delivery {delivery!r}; expected 'colocated' or "
                              f"'distributed'")
    from pytest_weightsync.transports import TransportRegistryError

    try:
        wire_transport(transport)
    except TransportRegistryError as error:
        raise WeightSyncError(f"unknown transport {transport!r} ({error}); the reference "
                              f"sends on {REFERENCE_TRANSPORTS} and on any registered "
                              f"transport") from None
    if format == "direct" and delivery == "colocated" and shards_are_engine_params(
            spec, trainer, receiver):
        # no gather: this rank's own shards are its engine rank's parameters
        payload = local_direct_payload(spec, model_state, trainer)
        return engine_streams(None, format=format, spec=spec, receiver=receiver,
                              delivery=delivery, bucket_bytes=bucket_bytes,
                              export=lambda *_: payload, transport=transport, engine=engine)
    return engine_streams(gather_full(spec, model_state), format=format, spec=spec,
                          receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes,
                          transport=transport, engine=engine)
