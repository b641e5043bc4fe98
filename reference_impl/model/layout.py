"""The one layout model every sync path shares: shapes, names and who owns what.

Megatron-Core holds MoE experts sharded by expert parallelism (EP: whole experts per rank),
expert tensor parallelism (ETP: rows of fc1 / columns of fc2) and pipeline parallelism
(PP: contiguous layers per stage). SGLang's ``FusedMoE`` holds them as two fused parameters
per layer, ``w13_weight [E_local, 2 * I_local, H]`` and ``w2_weight [E_local, H, I_local]``,
sharded by MoE-EP and MoE-TP. Every question of the form "which experts, which rows, which
rank, which name" is answered by this module's names and nowhere else, so a path that
disagrees with another path disagrees with this layout, and a new topology reaches every path
at once.

Everything here is pure: frozen dataclasses and functions of them. Impossible combinations
raise :class:`TopologyError` naming the constraint and the values that broke it.

This module is the layout's one import point; each job has a module of its own, and every
name below is theirs: the model shape (:mod:`.moe_spec`), weight names and their parsers
(:mod:`.expert_names`), the trainer's sharding (:mod:`.trainer_layout`) and the engine's
(:mod:`.receiver_layout`). Import from here; a layout question is added to the module of its
job and named here.
"""

from __future__ import annotations

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.model.expert_names import (
    ParsedName,
    fused_name,
    hf_expert_name,
    hf_fused_name,
    megatron_expert_name,
    name_problem,
    parse_megatron_name,
    parse_receiver_name,
)
from pytest_weightsync.reference_impl.model.moe_spec import (
    GATE_UP_ORDERS,
    PROJECTIONS,
    PROJECTION_INDEX,
    RECEIVER_PARAMS,
    EtpGroupedExperts,
    ExpertWeights,
    FullWeights,
    GroupedExperts,
    MoESpec,
    TopologyError,
    gate_up_halves,
    grouped_buffers,
    layer_device,
)
from pytest_weightsync.reference_impl.model.receiver_layout import (
    ReceiverShard,
    ReceiverTopology,
    ep_experts,
    packed_shape,
    receiver_param_shapes,
    receiver_shard,
    validate_receiver,
)
from pytest_weightsync.reference_impl.model.trainer_layout import (
    TrainerShard,
    TrainerTopology,
    stage_layers,
    trainer_groups,
    trainer_shard,
    validate_trainer,
)
from pytest_weightsync.vocabulary import (
    ENGINE_LAYOUTS,
    EXPERT_IMPLS,
    EXPERT_PLACEMENTS,
    ORDERS,
    PAD_MODES,
    WEIGHT_QUANTS,
)

__all__ = [
    "ENGINE_LAYOUTS",
    "EXPERT_IMPLS",
    "EXPERT_PLACEMENTS",
    "EtpGroupedExperts",
    "ExpertWeights",
    "FullWeights",
    "GATE_UP_ORDERS",
    "GroupedExperts",
    "MoESpec",
    "ORDERS",
    "PAD_MODES",
    "PROJECTIONS",
    "PROJECTION_INDEX",
    "ParsedName",
    "RECEIVER_PARAMS",
    "ReceiverShard",
    "ReceiverTopology",
    "TopologyError",
    "TrainerShard",
    "TrainerTopology",
    "WEIGHT_QUANTS",
    "WeightSyncError",
    "ep_experts",
    "fused_name",
    "gate_up_halves",
    "grouped_buffers",
    "hf_expert_name",
    "hf_fused_name",
    "layer_device",
    "megatron_expert_name",
    "name_problem",
    "packed_shape",
    "parse_megatron_name",
    "parse_receiver_name",
    "receiver_param_shapes",
    "receiver_shard",
    "stage_layers",
    "trainer_groups",
    "trainer_shard",
    "validate_receiver",
    "validate_trainer",
]
