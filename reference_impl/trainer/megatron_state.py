"""Real Megatron-Core training state of one trainer rank, built inside a torch.distributed rank.

A distributed exporter under test reads what a real trainer hands it, and this module builds
that as ``megatron.training.get_model`` does (NVIDIA/Megatron-LM ``megatron/training/
training.py``, ``get_model``, at 001b00c2734d8f0fad096fe48a382fedf755d321):

1. one ``GPTModel`` per model chunk (one chunk: no virtual pipeline stages), built with
   ``pre_process`` / ``post_process`` of this PP stage, CPU initialization, ``allgather``
   dispatcher. Its ``decoder.layers`` are real ``TransformerLayer`` s whose ``layer_number``
   is global (1-based, the PP offset included). Outside the experts it is a Qwen3-MoE as
   Megatron-Bridge configures one (:data:`QWEN3_MOE_CONFIG`, :data:`QWEN3_MOE_MODEL`): rotary
   positions (no position-embedding parameter), RMSNorm without bias, q/k RMS norms, no
   linear or qkv biases, untied embeddings - built from megatron-core's Transformer Engine
   layer spec, what real jobs build (:func:`qwen_layer_spec`: ``linear_qkv.layer_norm_weight``,
   ``pre_mlp_layernorm``, ``TENorm`` final norm, over the modelled TE of
   :mod:`~pytest_weightsync.reference_impl.trainer.te_spec`), so an exporter that converts every
   parameter meets only names a real Qwen3-MoE has. Its MoE block is
   :func:`layer_spec`'s: ``SequentialMLP`` experts of megatron-core's local spec, or for
   ``expert_impl="te_grouped"`` the ``TEGroupedMLP`` spec of
   :mod:`pytest_weightsync.reference_impl.trainer.te_grouped` (megatron's own TEGroupedMLP code
   over a modelled Transformer Engine ``GroupedLinear``);
2. ``tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes`` on every
   parameter (``tensor_model_parallel=False``, ``partition_dim=-1``, ``partition_stride=1``
   where the module set nothing: the router, norms, ...);
3. ``Float16Module(config, chunk)`` when the model is bf16/fp16;
4. megatron-core's ``DistributedDataParallel`` around each chunk, with the distributed
   optimizer's contiguous parameter buffer (``use_distributed_optimizer=True``: every
   parameter's storage is a view into one buffer per dtype group, as in RL trainers).

So a parameter is named ``module.module.decoder.layers.{l}.mlp.experts...`` (DDP, then
Float16Module; a float32 model has no Float16Module and one ``module.`` less), ``l`` local
to the stage, experts local to the EP rank. The expert weights are then overwritten with this
rank's synthetic shard values (in place: the model's storage is what the exporter sees, update
after update); every other parameter keeps Megatron's initialization.

The stand-ins, all named in ``docs/backends.md``: Transformer Engine's ``GroupedLinear`` (see
``te_grouped``) and its ``Linear`` / ``LayerNormLinear`` / norms under the attention (see
``te_spec``), and megatron-core's DDP allocates its buffers at
``torch.cuda.current_device()``, so it is constructed with that answering ``"cpu"``
(:func:`_ddp_buffers_on_cpu`); the DDP code itself is megatron-core's.

:func:`megatron_parallel_state` runs ``parallel_state.initialize_model_parallel`` for a
:class:`~pytest_weightsync.reference_impl.model.layout.TrainerTopology`, checks that Megatron put
this rank where the reference layout says it is, and always destroys the parallel state on
exit (ranks are reused by warm pools). Megatron-Core is imported inside the functions; a
missing package surfaces as ImportError for the caller to turn into a skip naming it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    TrainerTopology,
    WeightSyncError,
    megatron_expert_name,
    trainer_shard,
)

#: The prefix a DDP-wrapped (DistributedDataParallel around Float16Module) GPT model gives
#: every parameter name.
DDP_PREFIX = "module.module."
#: Megatron partition attributes exporters read.
PARTITION_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")
#: Vocabulary rows per dense TP rank of the (tiny) embedding and output layer.
VOCAB_PER_TP_RANK = 4
#: Attention head size: small and independent of the hidden size (which may be odd).
KV_CHANNELS = 2
#: ``TransformerConfig`` settings of every Qwen3-MoE outside its sizes and its ``GPTModel``
#: arguments, as Megatron-Bridge 0.3.1 sets them: views of the family's record
#: (:mod:`~pytest_weightsync.reference_impl.model.families.qwen3_moe` says where each comes
#: from), which decide which parameters exist. Held to the installed Bridge by
#: ``suites/selftest/test_trainer_model_names.py``.
QWEN3_MOE_CONFIG = dict(families.get("qwen3_moe").megatron_config)
QWEN3_MOE_MODEL = dict(families.get("qwen3_moe").megatron_model)


class MegatronPlacementError(WeightSyncError):
    """Megatron's parallel_state or model placed this rank differently from the reference
    layout (ranks, layers, experts), or its parameters do not match the reference shards."""


def transformer_config(spec: MoESpec, topo: TrainerTopology):
    """A real ``TransformerConfig`` of the model ``spec`` describes, under ``topo``."""
    from pytest_weightsync.reference_impl.backends.megatron import moe_transformer_config

    settings = dict(QWEN3_MOE_CONFIG)
    del settings["add_bias_linear"], settings["gated_linear_unit"]  # moe_transformer_config's own
    return moe_transformer_config(
        hidden=spec.hidden, ffn=spec.intermediate, experts=spec.num_experts,
        topk=min(2, spec.num_experts), tp=topo.tp, ep=topo.ep, etp=topo.etp, dtype=spec.dtype,
        grouped=topo.expert_impl == "te_grouped", cpu_init=True,
        num_layers=spec.num_layers,
        kv_channels=KV_CHANNELS,
        moe_router_pre_softmax=spec.num_experts == 1,  # Megatron requires it for top-1
        pipeline_model_parallel_size=topo.pp,
        pipeline_dtype=spec.dtype,
        **settings,
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


@contextlib.contextmanager
def _ddp_buffers_on_cpu():
    """megatron-core's ``_ParamAndGradBuffer`` allocates at ``torch.cuda.current_device()``;
    for the constructor's duration that answers ``"cpu"`` (the trainer state lives on CPU)."""
    import torch

    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def layer_spec(spec: MoESpec, topo: TrainerTopology, **local_options):
    """The ``TransformerLayer`` spec of every decoder layer: megatron-core's local GPT layer
    spec (``local_options``: more of ``get_gpt_layer_local_spec``'s keywords, e.g.
    ``qk_layernorm``), with TEGroupedMLP experts for ``expert_impl="te_grouped"``."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                     **local_options)
    if topo.expert_impl != "te_grouped":
        return local
    from pytest_weightsync.reference_impl.trainer.te_grouped import te_grouped_mlp_spec

    return dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, mlp=te_grouped_mlp_spec(spec.num_experts)))


def qwen_layer_spec(spec: MoESpec, topo: TrainerTopology, config):
    """This stage's ``TransformerBlockSubmodules`` of the expert-only trainer: every layer
    megatron-core's Transformer Engine layer spec with q/k norms (over the modelled TE of
    :mod:`~pytest_weightsync.reference_impl.trainer.te_spec`: the input norm fused into
    ``linear_qkv``, RMSNorm by ``config.normalization``) whose MoE block is
    :func:`layer_spec`'s (the experts every expert-only case was built with), and a ``TENorm``
    final norm."""
    import dataclasses

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from pytest_weightsync.reference_impl.trainer.te_spec import megatron_te_linears, te_layer_spec

    te = te_layer_spec(spec.num_experts, grouped=False, qk_layernorm=True)
    layer = dataclasses.replace(te, submodules=dataclasses.replace(
        te.submodules, mlp=layer_spec(spec, topo).submodules.mlp))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=megatron_te_linears()["TENorm"])


def build_model(spec: MoESpec, topo: TrainerTopology, config) -> list:
    """This rank's model chunks as ``get_model`` returns them (see the module docstring): a
    list of one megatron-core ``DistributedDataParallel``. Needs
    :func:`megatron_parallel_state` to be active."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    chunk = GPTModel(config=config, transformer_layer_spec=qwen_layer_spec(spec, topo, config),
                     vocab_size=VOCAB_PER_TP_RANK * topo.tp, max_sequence_length=8,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), **QWEN3_MOE_MODEL)
    return [wrapped(chunk, config)]


def wrapped(chunk, config, before_ddp=None, ddp_options=None):
    """``chunk`` (a ``GPTModel`` of this stage) wrapped as ``get_model`` wraps it: partition
    attribute defaults, ``Float16Module``, then DDP. ``before_ddp(chunk)`` runs between the
    last two (what a trainer keeps in float32 must be float32 before DDP groups the buffers);
    ``ddp_options``: more of ``DistributedDataParallelConfig`` (e.g. ``overlap_param_gather``)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    for param in chunk.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if config.fp16 or config.bf16:
        chunk = Float16Module(config, chunk)
    if before_ddp is not None:
        before_ddp(chunk)
    with _ddp_buffers_on_cpu():
        chunk = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, **(ddp_options or {})),
            module=chunk)
    return chunk


def unwrapped(chunk):
    """The ``GPTModel`` inside a DDP / Float16Module-wrapped chunk (``module.module...``)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def name_prefix(model_state) -> str:
    """The wrappers' prefix of the names (``module.module.`` for a bf16 DDP model)."""
    for name in model_state:
        if "decoder." in name:
            return name[:name.index("decoder.")]
    raise MegatronPlacementError("the model has no decoder parameter")


def _check_placement(spec: MoESpec, topo: TrainerTopology, rank: int, chunk) -> None:
    """The model's layers and experts are where the reference layout puts them."""
    shard = trainer_shard(spec, topo, rank)
    layers = list(unwrapped(chunk).decoder.layers)
    numbers = [layer.layer_number for layer in layers]
    if numbers != [layer + 1 for layer in shard.layers]:
        raise MegatronPlacementError(f"rank {rank}: Megatron built layer numbers {numbers}, the "
                                     f"reference layout gives this stage layers "
                                     f"{[layer + 1 for layer in shard.layers]} (1-based)")
    for layer in layers:
        experts = tuple(int(i) for i in layer.mlp.local_expert_indices)
        if experts != tuple(shard.experts):
            raise MegatronPlacementError(f"rank {rank}: Megatron's layer {layer.layer_number} "
                                         f"holds experts {experts}, the reference layout "
                                         f"{tuple(shard.experts)}")


def write_shards(params: dict, shard_values, rank: int) -> None:
    """Copy ``shard_values`` (``{megatron_expert_name: tensor}``, local numbering) into the
    model's expert parameters in place; every expert parameter must get exactly one."""
    prefix = name_prefix(params)
    targets = {}
    for name, value in shard_values.items():
        full_name = prefix + name
        if full_name not in params:
            raise MegatronPlacementError(
                f"rank {rank}: the Megatron model has no parameter {full_name!r} "
                f"(expert parameters: {sorted(n for n in params if '.experts.' in n)[:4]}...)")
        targets[full_name] = value
    unset = sorted(n for n in params if ".experts." in n and n not in targets)
    if unset:
        raise MegatronPlacementError(f"rank {rank}: expert parameters with no reference shard: "
                                     f"{unset[:4]}")
    fill_in_place(params, {name: ("", value) for name, value in targets.items()}, rank,
                  "the reference shard")


def fill_in_place(tensors: dict, values: dict, rank: int, source: str) -> None:
    """Copy ``values`` (``{real name: (source name or "", tensor)}``) into the real ``tensors`` of
    trainer rank ``rank`` in place, once every one of them is known to match its tensor's shape
    and dtype (nothing is written otherwise); ``source`` words where the values come from."""
    import torch

    for name, (own, value) in values.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(value.shape) or tensor.dtype != value.dtype:
            shown_own = f" {own}" if own else ""
            raise MegatronPlacementError(
                f"rank {rank}: {name} is {tuple(tensor.shape)} {tensor.dtype} in the Megatron "
                f"model, {source}{shown_own} is {tuple(value.shape)} {value.dtype}")
    with torch.no_grad():
        for name, (_, value) in values.items():
            tensors[name].copy_(value)


def megatron_model_state(spec: MoESpec, topo: TrainerTopology, rank: int, shard_values,
                         config=None) -> tuple[list, dict]:
    """``(model chunks, named_parameters of the chunk)`` of trainer rank ``rank``: the model
    :func:`build_model` builds, its placement checked against the reference layout, expert
    weights set to ``shard_values`` (as
    :func:`pytest_weightsync.reference_impl.trainer.trainer.trainer_state` builds them). Needs
    :func:`megatron_parallel_state` to be active."""
    config = transformer_config(spec, topo) if config is None else config
    model = build_model(spec, topo, config)
    _check_placement(spec, topo, rank, model[0])
    params = dict(model[0].named_parameters())
    expected = {megatron_expert_name(topo.expert_impl, li, ei, fc)
                for li in range(len(trainer_shard(spec, topo, rank).layers))
                for ei in range(len(trainer_shard(spec, topo, rank).experts)) for fc in (1, 2)}
    if set(shard_values) != expected:
        raise MegatronPlacementError(f"rank {rank}: shard values for {sorted(shard_values)[:4]}"
                                     f"..., the layout expects {sorted(expected)[:4]}...")
    write_shards(params, shard_values, rank)
    return model, params
