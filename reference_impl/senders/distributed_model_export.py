"""The reference distributed exporter of a whole model: what runs in every rank of a real job.

It reads what a real trainer holds - this rank's parameters and the routers' ``expert_bias``
buffers of a (DDP-wrapped) ``GPTModel`` stage, local layer numbering, megatron-core's local
spec names - and the process groups of ``megatron.core.parallel_state``, then:

1. names each tensor globally: a stage's layer ``l`` is layer ``layer_number - 1`` of its real
   ``TransformerLayer`` (the PP offset, uneven stages included), or, without the model, the
   offset Megatron computes from the config (``get_transformer_layer_offset``);
2. gathers every non-expert tensor over the dense TP group and converts it to checkpoint
   tensors with the trainer layout's conversions (:mod:`~pytest_weightsync.reference_impl.
   megatron_model`: ``unshard`` / ``checkpoint_tensors`` - query-group ``linear_qkv`` split
   into q/k/v (and the output gate), component-major ``[gate; up]`` of the shared expert,
   vocab padding dropped), in the tensor's own dtype (float32 router and expert bias stay
   float32); copies of the embedding are not read (a tied model's last-stage
   ``output_layer``, the embedding of the MTP block's stage);
3. gathers the routed experts (the MTP block's too, on its stage) over the ETP and EP groups
   (:func:`~pytest_weightsync.reference_impl.senders.distributed_export.gather_full`, within the stage);
4. joins the stages over the PP group (objects: stages of unequal size);
5. builds each engine rank's payload with the whole-model senders
   (:func:`pytest_weightsync.reference_impl.senders.model_senders.export`) and delivers it as the
   expert-only exporter does (:func:`~pytest_weightsync.reference_impl.senders.distributed_export.
   engine_streams`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Mapping, Optional

from pytest_weightsync.reference_impl.senders.distributed_export import (
    NO_PP_GATHER,
    ModelStateError,
    engine_streams,
    gather_full,
)

_LOCAL_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


def layer_offset(config, model=None) -> int:
    """This stage's first global layer (0-based): from the real layers' ``layer_number`` when
    ``model`` (the chunks) is given, else Megatron's own offset for the config."""
    if model is not None:
        from pytest_weightsync.reference_impl.trainer.megatron_state import unwrapped

        layers = list(unwrapped(model[0]).decoder.layers)
        if layers:
            return layers[0].layer_number - 1
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config)


def global_name(local_name: str, offset: int) -> str:
    """``decoder.layers.{l}...`` of a stage as ``decoder.layers.{l + offset}...``."""
    m = _LOCAL_LAYER.match(local_name)
    return local_name if m is None else f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"


def gather_dense(spec, trainer, model_state: Mapping, offset: int, tp_group, *,
                 stage: int = 0) -> dict:
    """``{checkpoint name: full tensor}`` of every non-expert tensor of pipeline stage
    ``stage``, gathered over ``tp_group``; copies of the first stage's embedding are not read
    (:func:`~pytest_weightsync.reference_impl.trainer.megatron_model.is_embedding_copy`). Collective
    over the TP group."""
    from pytest_weightsync.reference_impl.trainer import megatron_model
    from pytest_weightsync.reference_impl.trainer.megatron_state import name_prefix
    from pytest_weightsync.reference_impl.trainer.megatron_whole import modelled_name
    from pytest_weightsync.reference_impl.trainer.trainer import all_gather_bits

    whole = replace(trainer, pp=1, first_stage_layers=None)  # every layer under its global name
    catalogue = {p.name: p for p in megatron_model.trainer_params(spec, whole)}
    prefix = name_prefix(model_state)
    dense = {}
    for name, tensor in model_state.items():
        own = modelled_name(name[len(prefix):])
        if ".mlp.experts." in own or megatron_model.is_embedding_copy(spec, own, stage):
            continue  # routed experts: step 3; copies of the first stage's embedding
        param = catalogue.get(global_name(own, offset))
        if param is None:
            raise ModelStateError(f"{name}: not a parameter of {spec.id} (read as "
                                  f"{global_name(own, offset)!r})")
        shards = ([tensor.detach()] if param.kind == "replicated"
                  else all_gather_bits(tensor.detach(), tp_group))
        dense.update(megatron_model.checkpoint_tensors(
            spec, param, megatron_model.unshard(param, shards)))
    return dense


def _join_stages(parts: tuple, pp_group) -> tuple:
    """Every stage's ``parts`` (dicts) merged, on every stage. Collective over ``pp_group``."""
    import torch.distributed as dist

    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return parts
    stages = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, parts, group=pp_group)
    merged = tuple({} for _ in parts)
    for stage in stages:
        for into, part in zip(merged, stage):
            into.update(part)
    return merged


def draft_state(model_state: Mapping) -> dict:
    """The MTP block's expert tensors under the decoder's names (``mtp.layers.{l}.
    transformer_layer.X`` as ``decoder.layers.{l}.X``), for the expert gather."""
    out = {}
    for name, tensor in model_state.items():
        head, sep, rest = name.partition("mtp.layers.")
        if sep and ".mlp.experts." in rest:
            out[head + "decoder.layers." + rest.replace(".transformer_layer.", ".", 1)] = tensor
    return out


def gather_model(spec, trainer, model_state: Mapping, *, config, model=None):
    """The whole checkpoint (a :class:`~pytest_weightsync.reference_impl.model.model_spec.
    ModelWeights`) on every rank, from this rank's tensors. Collective over the world."""
    from megatron.core import parallel_state as ps

    from pytest_weightsync.reference_impl.model.model_spec import hf_params
    from pytest_weightsync.reference_impl.model.model_spec import ModelWeights

    offset = layer_offset(config, model)
    dense = gather_dense(spec, trainer, model_state, offset,
                         ps.get_tensor_model_parallel_group(),
                         stage=ps.get_pipeline_model_parallel_rank())
    local = gather_full(spec.experts, model_state, pp=NO_PP_GATHER)
    experts = {layer + offset: weights for layer, weights in local.items()}
    draft = {}
    if spec.mtp_layers and ps.is_pipeline_last_stage():  # the MTP block's stage
        draft = gather_full(spec.draft_experts, draft_state(model_state), pp=NO_PP_GATHER)
    dense, experts, draft = _join_stages((dense, experts, draft),
                                         ps.get_pipeline_model_parallel_group())
    missing = [name for name in hf_params(spec) if name not in dense]
    if (missing or sorted(experts) != list(range(spec.num_layers))
            or sorted(draft) != list(range(spec.mtp_layers))):
        raise ModelStateError(f"gathered {len(dense)} checkpoint tensors, expert layers "
                              f"{sorted(experts)} and draft expert layers {sorted(draft)}; "
                              f"{spec.id} lacks {missing[:4]}")
    targets = {"target": experts, **({"draft": draft} if spec.mtp_layers else {})}
    return ModelWeights({name: dense[name] for name in hf_params(spec)}, targets)


def export_weights_distributed(model_state, *, config, format, spec, trainer, receiver,
                               delivery, bucket_bytes: Optional[int], model=None):
    """See the module docstring. Collective over every rank of the trainer world. A model
    whose DDP defers its param all-gather (distributed optimizer, ``overlap_param_gather``)
    completes it first: between the optimizer step and the next forward every rank's
    parameters hold stale copies of the other DP ranks' shards (NeMo-RL#4086)."""
    from pytest_weightsync.reference_impl.senders import model_senders
    from pytest_weightsync.reference_impl.trainer.param_sync import sync_params_before_refit

    sync_params_before_refit(model)
    return engine_streams(gather_model(spec, trainer, model_state, config=config, model=model),
                          format=format, spec=spec, receiver=receiver, delivery=delivery,
                          bucket_bytes=bucket_bytes, export=model_senders.export)
