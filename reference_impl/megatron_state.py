"""Real Megatron-Core training state of one trainer rank, built inside a torch.distributed rank.

A distributed exporter under test reads what a real trainer hands it: the rank's own
``named_parameters()`` of a DDP-wrapped model (``module.module.decoder.layers.{l}...``),
real ``nn.Parameter`` objects carrying Megatron's partition attributes, the model's
``TransformerConfig``, and the process groups of ``megatron.core.parallel_state``. This
module builds that state:

* :func:`megatron_parallel_state` runs ``parallel_state.initialize_model_parallel`` for a
  :class:`~pytest_weightsync.reference_impl.layout.TrainerTopology` (TP, PP, EP, ETP) over the
  current world, checks that Megatron put this rank where the reference layout says it is,
  and always destroys the parallel state on exit (ranks are reused by warm pools).
* :func:`megatron_model_state` builds one real ``MoELayer`` (``get_moe_module_spec(use_te=
  False)``, CPU initialization, ``allgather`` dispatcher) per local layer of this PP stage,
  wraps the layers the way a DDP-wrapped GPT model nests them, and overwrites the expert
  weights with this rank's synthetic shard values.

TEGroupedMLP needs Transformer Engine (and CUDA), so for ``expert_impl="te_grouped"`` the
expert parameters are MODELLED, not built: the SequentialMLP values are re-registered under
TEGroupedMLP's names (``experts.linear_fc1.weight{i}``) with the attributes megatron-core's
``TEGroupedLinear`` sets (``allreduce = not expert_parallel``; with explicit expert comms -
ETP or EP > 1 - Megatron hands Transformer Engine ``parallel_mode=None`` so the weights are
not marked tensor-parallel; otherwise column (fc1, dim 0) / row (fc2, dim 1) parallel).

Megatron-Core is imported inside the functions; a missing package surfaces as ImportError
for the caller to turn into a skip naming it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from pytest_weightsync.reference_impl.layout import (
    MoESpec,
    TrainerTopology,
    WeightSyncError,
    megatron_expert_name,
    trainer_shard,
)

#: The prefix a DDP-wrapped (Float16Module inside DistributedDataParallel) GPT model gives
#: every parameter name.
DDP_PREFIX = "module.module."
#: Megatron partition attributes exporters read.
PARTITION_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


class MegatronPlacementError(WeightSyncError):
    """Megatron's parallel_state placed this rank differently from the reference layout."""


def transformer_config(spec: MoESpec, topo: TrainerTopology):
    """A real ``TransformerConfig`` of the model ``spec`` describes, under ``topo``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        num_attention_heads=topo.tp,
        ffn_hidden_size=spec.intermediate,
        moe_ffn_hidden_size=spec.intermediate,
        num_moe_experts=spec.num_experts,
        moe_router_topk=min(2, spec.num_experts),
        moe_router_pre_softmax=spec.num_experts == 1,  # Megatron requires it for top-1
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        pipeline_dtype=spec.dtype,
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.etp,
        params_dtype=spec.dtype,
        bf16=spec.dtype == torch.bfloat16,
        fp16=spec.dtype == torch.float16,
    )


@contextlib.contextmanager
def megatron_parallel_state(spec: MoESpec, topo: TrainerTopology) -> Iterator[object]:
    """Initialize Megatron's model-parallel state for ``topo`` in this rank, yield the
    ``parallel_state`` module, destroy the state on exit (also when the body raises).
    Collective: every rank of the world must enter."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.backends.megatron import model_parallel

    if dist.get_world_size() != topo.world_size:
        raise MegatronPlacementError(f"world size {dist.get_world_size()} != trainer world size "
                                     f"{topo.world_size} ({topo})")
    with model_parallel(
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.etp,
        create_gloo_process_groups=False,  # the default group is gloo already
    ) as ps:
        shard = trainer_shard(spec, topo, dist.get_rank())
        placed = {"pp_rank": ps.get_pipeline_model_parallel_rank(),
                  "tp_rank": ps.get_tensor_model_parallel_rank(),
                  "ep_rank": ps.get_expert_model_parallel_rank(),
                  "etp_rank": ps.get_expert_tensor_parallel_rank()}
        wrong = {k: (v, getattr(shard, k)) for k, v in placed.items() if v != getattr(shard, k)}
        if wrong:
            raise MegatronPlacementError(
                f"rank {shard.rank}: Megatron's parallel_state disagrees with the reference "
                f"layout ({', '.join(f'{k}: megatron {a}, reference {b}' for k, (a, b) in wrong.items())})")
        yield ps


def _build_moe_layers(spec: MoESpec, config, count: int):
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    module_spec = get_moe_module_spec(use_te=False, num_experts=spec.num_experts,
                                      moe_grouped_gemm=False)
    layers = torch.nn.ModuleList()
    for local in range(count):
        block = torch.nn.Module()
        block.mlp = build_module(module_spec, config=config, layer_number=local + 1)
        layers.append(block)
    return layers


def _as_te_grouped(block, num_local: int, etp: int, ep: int) -> None:
    """Re-register ``block.mlp.experts``' SequentialMLP weights under TEGroupedMLP's names and
    attributes (modelled: TEGroupedMLP itself needs Transformer Engine)."""
    import torch

    explicit_comm = etp > 1 or ep > 1
    experts = torch.nn.Module()
    for fc, dim in (("linear_fc1", 0), ("linear_fc2", 1)):
        linear = torch.nn.Module()
        for i in range(num_local):
            source = getattr(block.mlp.experts.local_experts[i], fc).weight
            param = torch.nn.Parameter(source.detach().clone(), requires_grad=True)
            param.allreduce = not ep > 1
            param.tensor_model_parallel = not explicit_comm
            param.partition_dim = dim if not explicit_comm else -1
            param.partition_stride = 1
            linear.register_parameter(f"weight{i}", param)
        setattr(experts, fc, linear)
    block.mlp.experts = experts


def megatron_model_state(spec: MoESpec, topo: TrainerTopology, rank: int, shard_values,
                         config=None) -> tuple[object, dict]:
    """``(model, named_parameters)`` of trainer rank ``rank``: real MoE layers of this PP
    stage, nested as in a DDP-wrapped GPT model, expert weights set to ``shard_values``
    (``{megatron_expert_name: tensor}``, local numbering, as
    :func:`pytest_weightsync.reference_impl.trainer.trainer_state` builds them).
    Needs :func:`megatron_parallel_state` to be active."""
    import torch

    shard = trainer_shard(spec, topo, rank)
    config = transformer_config(spec, topo) if config is None else config
    decoder = torch.nn.Module()
    decoder.layers = _build_moe_layers(spec, config, len(shard.layers))
    if topo.expert_impl == "te_grouped":
        for block in decoder.layers:
            _as_te_grouped(block, len(shard.experts), topo.etp, topo.ep)
    inner = torch.nn.Module()
    inner.decoder = decoder
    model = torch.nn.Module()
    model.module = torch.nn.Module()
    model.module.module = inner
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in shard_values.items():
            full_name = DDP_PREFIX + name
            if full_name not in params:
                raise MegatronPlacementError(
                    f"rank {rank}: the Megatron model has no parameter {full_name!r} "
                    f"(expert parameters: {sorted(n for n in params if '.experts.' in n)[:4]}...)")
            target = params[full_name]
            if tuple(target.shape) != tuple(value.shape) or target.dtype != value.dtype:
                raise MegatronPlacementError(
                    f"rank {rank}: {full_name} is {tuple(target.shape)} {target.dtype} in the "
                    f"Megatron model, the reference shard is {tuple(value.shape)} {value.dtype}")
            target.copy_(value)
    expected = {DDP_PREFIX + megatron_expert_name(topo.expert_impl, li, ei, fc)
                for li in range(len(shard.layers)) for ei in range(len(shard.experts))
                for fc in (1, 2)}
    unset = sorted(n for n in params if ".experts." in n and n not in expected)
    if unset:
        raise MegatronPlacementError(f"rank {rank}: expert parameters with no reference shard: "
                                     f"{unset[:4]}")
    return model, params
