"""An example distributed exporter of a whole model, written the way RL trainers' Megatron -> HF
refit code is, and a copy of it with the layer-numbering bug pipelined exporters have shipped.

It runs in every trainer rank with the rank's own tensors - the DDP-wrapped ``GPTModel``
stage's ``named_parameters()`` plus the routers' ``expert_bias`` buffers, stage-local layer
numbers - and megatron-core's ``parallel_state`` process groups:

1. every non-expert tensor is gathered over the dense TP group and converted to checkpoint
   tensors (:mod:`.megatron_names`), in its own dtype; decoder layer ``l`` of the stage is
   checkpoint layer ``l + offset``, the offset read from the stage's real
   ``TransformerLayer.layer_number`` (``model=``) or, without the model, computed by
   megatron-core from the config (``get_transformer_layer_offset``: uneven stages included);
2. copies of the first stage's embedding are not read: a tied model's ``output_layer`` and,
   with PP > 1, the embedding ``GPTModel`` builds on the MTP block's stage - the checkpoint has
   one source, so sending them sends the embedding twice;
3. the routed experts are gathered over ETP and EP within the stage as the expert-only
   exporter does (:meth:`.exporter.ExampleDistributedExporter.gather_stage`), the MTP block's
   experts too (its layer ``i`` is the draft's layer ``i``);
4. the stages are joined over the PP group as Python objects (stages may differ in size):
   each stage contributes its own tensors to the payload, its experts named by its offset;
5. the payload is named for SGLang: ``compat`` (checkpoint names, per-expert experts, the
   draft under ``mtp.``) or ``direct`` (each engine rank's own parameters,
   :mod:`.engine_tensors`, the draft's under ``draft.``), cut into buckets and delivered as
   the expert-only exporter delivers.

Expert-only updates (a spec without a ``family``) go to the expert-only exporter unchanged.

``StageLocalLayersExporter`` is the same exporter naming each stage's layers from 0 (the
module index instead of ``layer_number - 1``): right on one stage, wrong for every PP > 1
layout - the first stage's layers arrive more than once and the later stages' never.
``EmbeddingCopySentExporter`` reads the MTP stage's embedding copy as a tensor of its own:
right without an MTP block or on one stage, and with both the embedding arrives twice.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

import torch

from pytest_weightsync.protocols import MODEL_PARTS, TARGETS, Capabilities

from weightsync_example_loader import megatron_names
from weightsync_example_loader.engine_tensors import engine_tensors
from weightsync_example_loader.exporter import (
    ExampleDistributedExporter,
    _all_gather,
    _local_experts,
)

_WRAPPER = "module."
_LAYER = re.compile(r"^(model\.layers\.)(\d+)")


def _own_name(name: str) -> str:
    """``name`` without the DDP / ``Float16Module`` wrappers' ``module.`` prefixes."""
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER):]
    return name


def _draft_view(model_state) -> dict:
    """The MTP block's routed experts under decoder names (``mtp.layers.{i}.transformer_layer.
    mlp.experts...`` as ``decoder.layers.{i}.mlp.experts...``), for the expert gather."""
    out = {}
    for name, tensor in model_state.items():
        head, sep, rest = _own_name(name).partition("mtp.layers.")
        if sep and ".mlp.experts." in rest:
            out["decoder.layers." + rest.replace(".transformer_layer.", ".", 1)] = tensor
    return out


def _shifted(pairs, offset: int) -> list:
    """``pairs`` with ``model.layers.{l}`` renamed ``model.layers.{l + offset}``."""
    if not offset:
        return pairs
    return [(_LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}", name, count=1), t)
            for name, t in pairs]


class Stage(NamedTuple):
    """What one pipeline stage gathered: its first global layer, its checkpoint tensors
    (global names), its experts ``[L_stage, E, ...]`` and its draft's (``None``: no MTP
    block on this stage)."""

    offset: int
    dense: dict
    fc1: torch.Tensor
    fc2: torch.Tensor
    draft_fc1: Optional[torch.Tensor]
    draft_fc2: Optional[torch.Tensor]

    def owned(self) -> "Stage":
        """A copy holding its own tensors, for the PP gather: a replicated parameter is a
        view of DDP's whole buffer, which pickling would send with it."""
        def own(t):
            return None if t is None else t.clone()

        return Stage(self.offset, {k: own(v) for k, v in self.dense.items()},
                     *(own(t) for t in self[2:]))


class ExampleModelExporter(ExampleDistributedExporter):
    """Distributed exporter of whole models (compat and unpadded direct payloads, both gate/up
    orders, the MTP draft included) and of expert-only updates (compat, packed, direct)."""

    name = "example-model-exporter"
    capabilities = Capabilities(formats={"compat", "packed", "direct"}, padded=False,
                                model_parts=MODEL_PARTS, targets=TARGETS)

    # -- where the stage's layers are -------------------------------------------------------

    @staticmethod
    def layer_offset(config, model=None) -> int:
        """This stage's first global layer (0-based)."""
        if model is not None:
            chunk = model[0]
            while hasattr(chunk, "module"):  # DDP, Float16Module
                chunk = chunk.module
            layers = list(chunk.decoder.layers)
            if layers:
                return layers[0].layer_number - 1
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return get_transformer_layer_offset(config)

    @staticmethod
    def is_embedding_copy(spec, own: str, first_stage: bool) -> bool:
        """A copy of the first stage's embedding (see the module docstring, step 2)."""
        return ((spec.tied and own == "output_layer.weight")
                or (own == megatron_names.EMBEDDING and not first_stage))

    # -- gathering --------------------------------------------------------------------------

    def gather_dense(self, model_state, spec, offset: int) -> dict:
        """``{checkpoint name: full tensor}`` of this stage's non-expert tensors. Collective
        over the dense TP group (every TP rank of a stage holds the same names, in order)."""
        from megatron.core import parallel_state as mpu

        tp = mpu.get_tensor_model_parallel_group()
        first = mpu.is_pipeline_first_stage()
        dense = {}
        for name, tensor in model_state.items():
            own = _own_name(name)
            if ".mlp.experts." in own or self.is_embedding_copy(spec, own, first):
                continue
            conv = megatron_names.conversion(spec, own, offset)
            shards = ([tensor.detach()] if conv.kind == "replicated"
                      else _all_gather(tensor.detach(), tp))
            dense.update(megatron_names.checkpoint_tensors(spec, conv, shards))
        return dense

    def gather_experts(self, state) -> tuple:
        """``(fc1 [L_stage, E, 2I, H], fc2 [L_stage, E, H, I])`` of the experts in ``state``
        (decoder names, stage-local layers), or ``(None, None)`` when it holds none.
        Collective over the ETP and EP groups."""
        if not state:
            return None, None
        return self.gather_stage(_local_experts(state))

    @staticmethod
    def sync_params_before_refit(model) -> None:
        """Between the optimizer step and the next forward, a DDP model with the distributed
        optimizer and ``overlap_param_gather`` holds only its own DP shard fresh: complete
        the deferred param all-gather before reading (megatron-core's
        ``start_param_sync(force_sync=True)``; NeMo-RL#4086)."""
        for chunk in model or ():
            ddp = getattr(chunk, "ddp_config", None)
            if ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)

    def gather_model(self, model_state, spec, *, config, model=None) -> list:
        """Every stage's :class:`Stage`, in pipeline order, on every rank. Collective over the
        world: TP, ETP and EP within the stage, then the PP group (as Python objects, stages
        may differ in size)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        self.sync_params_before_refit(model)
        offset = self.layer_offset(config, model)
        dense = self.gather_dense(model_state, spec, offset)
        fc1, fc2 = self.gather_experts(model_state)
        # only the MTP block's stage holds the draft
        draft_fc1, draft_fc2 = self.gather_experts(_draft_view(model_state))
        stage = Stage(offset, dense, fc1, fc2, draft_fc1, draft_fc2)
        group = mpu.get_pipeline_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return [stage]
        stages = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, stage.owned(), group=group)
        return stages

    # -- naming -----------------------------------------------------------------------------

    def stage_payload(self, format, spec, receiver, engine_rank, stage: "Stage") -> list:
        """``[(name, tensor)]`` one stage contributes to engine rank ``engine_rank``: its
        non-expert tensors, its experts (layers shifted to global ids), its draft's."""
        if format == "compat":
            out = list(stage.dense.items()) + _shifted(self.compat(stage.fc1, stage.fc2),
                                                       stage.offset)
            if stage.draft_fc1 is not None:
                out += [("mtp." + n[len("model."):], t)
                        for n, t in self.compat(stage.draft_fc1, stage.draft_fc2)]
            return out
        if format == "direct":
            out = (engine_tensors(spec, stage.dense, receiver.tp, engine_rank)
                   + _shifted(self.direct(stage.fc1, stage.fc2, receiver, engine_rank),
                              stage.offset))
            if stage.draft_fc1 is not None:
                out += [("draft." + n, t) for n, t in self.direct(
                    stage.draft_fc1, stage.draft_fc2, receiver, engine_rank)]
            return out
        raise ValueError(f"{self.name} exports whole models in compat and direct, not {format}")

    def model_payload(self, format, spec, receiver, engine_rank, stages) -> list:
        """The whole model's ``[(name, tensor)]`` for engine rank ``engine_rank``."""
        return [pair for stage in stages
                for pair in self.stage_payload(format, spec, receiver, engine_rank, stage)]

    # -- the role ---------------------------------------------------------------------------

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None):
        if not hasattr(spec, "family"):  # experts only
            return super().export_weights_distributed(
                model_state, config=config, format=format, spec=spec, trainer=trainer,
                receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
        stages = self.gather_model(model_state, spec, config=config, model=model)
        if format == "compat":  # the same tensors for every engine rank: named once
            named = self.model_payload(format, spec, receiver, 0, stages)
            return self.deliver(lambda _: named, receiver=receiver, delivery=delivery,
                                bucket_bytes=bucket_bytes)
        return self.deliver(
            lambda rank: self.model_payload(format, spec, receiver, rank, stages),
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)


class StageLocalLayersExporter(ExampleModelExporter):
    """The same exporter with the bug: every stage names its layers from 0."""

    name = "example-model-stage-local"

    @staticmethod
    def layer_offset(config, model=None) -> int:
        return 0


class EmbeddingCopySentExporter(ExampleModelExporter):
    """The same exporter with the bug: the MTP stage's copy of the embedding (PP > 1) is read
    as if it were a tensor of its own, so the embedding is sent by two stages."""

    name = "example-model-embedding-copy"

    @staticmethod
    def is_embedding_copy(spec, own: str, first_stage: bool) -> bool:
        return spec.tied and own == "output_layer.weight"


class FlattenedMetadata(NamedTuple):
    """SGLang's ``FlattenedTensorMetadata`` fields (``start_idx``, ``end_idx`` and ``numel``
    counted in bytes of the flattened buffer)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flattened_bucket(named) -> dict:
    """``named`` (``[(name, tensor)]``, any mixture of dtypes) as SGLang's flattened bucket
    (``load_format="flattened_bucket"``): every tensor's bytes in one ``uint8`` buffer, each
    starting at an offset that is a multiple of its item size - the engine views each slice
    as its dtype, so a float32 router after an odd number of bf16 elements would not
    reconstruct (verl#7318)."""
    pieces, metadata, offset = [], [], 0
    for name, tensor in named:
        size = tensor.element_size()
        start = -(-offset // size) * size
        if start > offset:
            pieces.append(torch.zeros(start - offset, dtype=torch.uint8, device=tensor.device))
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces.append(data)
        metadata.append(FlattenedMetadata(name, tuple(tensor.shape), tensor.dtype, start,
                                          start + data.numel(), data.numel()))
        offset = start + data.numel()
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}


class FlattenedModelExporter(ExampleModelExporter):
    """The same whole-model exporter sending each bucket as SGLang's flattened bucket, as
    slime's colocated path does: the float32 router and expert bias travel beside the bf16
    weights in one buffer (:func:`flattened_bucket`)."""

    name = "example-model-flattened"

    def buckets(self, named, bucket_bytes):
        return [flattened_bucket(bucket) for bucket in super().buckets(named, bucket_bytes)]
