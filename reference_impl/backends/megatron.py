"""Real Megatron-Core MoE layers, built inside torch.distributed ranks, and their expert shards.

The reference models how a Megatron trainer holds expert weights (which rank owns which
expert, how fc1/fc2 are split under expert tensor parallelism, what the parameters are
called). This module builds the real thing so the suites can check that model against it:

* :func:`megatron_moe_layer` initializes Megatron's model-parallel state for a
  (TP, EP, ETP) topology in the current rank, builds a ``MoELayer`` from
  ``get_moe_module_spec`` with CPU initialization, and always destroys the parallel state
  afterwards, so a warm rank process can build the next topology.
* :func:`expert_parameters` reads the layer's expert parameters by their own names and
  partition attributes (``partition_dim``, ``partition_stride``, ``allreduce``, ...).
* :func:`write_expert_shards` / :func:`read_expert_shards` put known values into the sharded
  parameters the way a trainer holds them, and read them back as a state dict.
* :func:`te_grouped_names` renames SequentialMLP shards to TEGroupedMLP's
  ``linear_fc1.weight{i}`` naming, for exporters that must accept both;
  :func:`te_grouped_sharded_state_dict` checks that naming against Megatron-Core's own
  TEGroupedMLP checkpoint code (TEGroupedMLP itself needs Transformer Engine and is never built).

Must run in a process where ``torch.distributed`` is initialized (gloo on CPU). Megatron-Core
is imported inside the functions, so importing this module is cheap and never fails.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

from pytest_weightsync.vocabulary import EXPERT_IMPLS

#: Expert types this module can build: the TE-free SequentialMLP everywhere, TEGroupedMLP
#: where Transformer Engine imports (it also needs CUDA).
EXPERT_TYPES = EXPERT_IMPLS

_SEQUENTIAL_NAME = re.compile(r"^(?:.*\.)?experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_GROUPED_NAME = re.compile(r"^(?:.*\.)?experts\.(linear_fc[12])\.weight(\d+)$")
_TE_STACKED_NAME = re.compile(r"^(?:.*\.)?experts\.(linear_fc[12])\.weight$")

#: A weight entry of a sharded state dict: ``...weight`` (SequentialMLP) or ``...weight{i}`` (TE).
_WEIGHT_KEY = re.compile(r"\.weight\d*$")

_PARTITION_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


class MegatronTopologyError(ValueError):
    """A (TP, EP, ETP, world size, experts, ffn) combination Megatron cannot build."""


class ExpertShardError(ValueError):
    """Shards that do not match the layer's expert parameters (name, shape or dtype)."""


@dataclass(frozen=True)
class MegatronMoEConfig:
    """One MoE layer and the trainer topology it is built under.

    ``ffn_hidden_size`` is the per-expert intermediate size F (Megatron's
    ``moe_ffn_hidden_size``); fc1 holds ``2F/etp`` rows per rank because the experts are
    gated (SwiGLU).
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: str = "bfloat16"
    expert_type: str = "sequential"
    topk: int = 2

    def check(self, world_size: int) -> None:
        """Raise :class:`MegatronTopologyError` naming the first constraint broken."""
        for field in ("hidden_size", "ffn_hidden_size", "num_experts", "tp", "ep", "etp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise MegatronTopologyError(f"MegatronMoEConfig.{field} must be a positive int, got {value!r}")
        if self.expert_type not in EXPERT_TYPES:
            raise MegatronTopologyError(
                f"MegatronMoEConfig.expert_type must be one of {EXPERT_TYPES}, got {self.expert_type!r}"
            )
        if world_size % self.tp:
            raise MegatronTopologyError(f"world size {world_size} is not divisible by tp={self.tp}")
        if world_size % (self.ep * self.etp):
            raise MegatronTopologyError(
                f"world size {world_size} is not divisible by ep*etp={self.ep}*{self.etp}"
            )
        if self.num_experts % self.ep:
            raise MegatronTopologyError(
                f"num_experts={self.num_experts} is not divisible by ep={self.ep}"
            )
        if self.ffn_hidden_size % self.etp:
            raise MegatronTopologyError(
                f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by etp={self.etp}"
            )
        if self.topk > self.num_experts:
            raise MegatronTopologyError(f"topk={self.topk} exceeds num_experts={self.num_experts}")


@dataclass(frozen=True)
class MegatronPlacement:
    """Where Megatron put the current rank, as reported by ``parallel_state``."""

    rank: int
    world_size: int
    tp_rank: int
    ep_rank: int
    etp_rank: int
    local_expert_indices: tuple[int, ...]


@dataclass(frozen=True)
class ExpertParameter:
    """One expert weight as the real layer holds it.

    ``name`` is the parameter's own name within the MoE layer (e.g.
    ``experts.local_experts.1.linear_fc1.weight``); ``global_expert`` comes from the layer's
    ``local_expert_indices``, not from the reference's ownership math.
    """

    name: str
    local_expert: int
    global_expert: int
    projection: str
    shape: tuple[int, ...]
    dtype: str
    tensor_model_parallel: bool | None
    partition_dim: int | None
    partition_stride: int | None
    allreduce: bool | None


def _dtype(name: str):
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise MegatronTopologyError(f"MegatronMoEConfig.dtype {name!r} is not a torch dtype")
    return value


def moe_transformer_config(*, hidden: int, ffn: int, experts: int, topk: int, tp: int,
                           ep: int, etp: int, dtype, grouped: bool, cpu_init: bool,
                           heads: int | None = None, **more):
    """A real ``TransformerConfig`` of gated (SwiGLU) MoE layers without biases, experts of
    ``ffn`` rows, ``heads`` attention heads (default one per TP rank); ``more`` adds what a
    caller's model needs (layers, pipeline, head size, router options)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        hidden_size=hidden,
        num_attention_heads=tp if heads is None else heads,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=cpu_init,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **more,
    )


def _transformer_config(cfg: MegatronMoEConfig):
    return moe_transformer_config(
        hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, experts=cfg.num_experts, topk=cfg.topk,
        tp=cfg.tp, ep=cfg.ep, etp=cfg.etp, dtype=_dtype(cfg.dtype),
        grouped=cfg.expert_type == "te_grouped", cpu_init=cfg.expert_type == "sequential",
        num_layers=1)


def _module_spec(cfg: MegatronMoEConfig):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(
        use_te=cfg.expert_type == "te_grouped",
        num_experts=cfg.num_experts,
        moe_grouped_gemm=cfg.expert_type == "te_grouped",
    )


@contextlib.contextmanager
def model_parallel(**sizes) -> Iterator[object]:
    """``parallel_state.initialize_model_parallel(**sizes)`` for the body, then tear it down
    completely; yields the ``parallel_state`` module. Collective: every rank must enter.

    ``destroy_model_parallel`` only forgets Megatron's groups; the torch.distributed process
    groups stay alive, each gloo group with its own threads and sockets. A warm rank process
    that builds topology after topology would pile up hundreds of threads (and slow every
    later test), so every group Megatron created in this rank is destroyed here as well. It
    does not even forget all of them: megatron-core 0.16.1 leaves
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` (and its ``_GLOO`` twin) set, which keeps
    two destroyed gloo groups' threads and sockets alive until the next initialization; every
    module global still naming a destroyed group is cleared too."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**sizes)
    try:
        yield ps
    finally:
        # Megatron hands the same group object out under several names (one list entry each).
        created = {id(g): g for g in (getattr(ps, "_global_process_group_list", None) or ())
                   if g is not None}
        ps.destroy_model_parallel()
        for group in created.values():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # not registered with torch.distributed (e.g. already gone)
                pass
        for name, value in list(vars(ps).items()):
            if name.isupper() and id(value) in created and value is created[id(value)]:
                setattr(ps, name, None)  # a stale handle keeps a gloo group's threads alive


@contextlib.contextmanager
def megatron_moe_layer(cfg: MegatronMoEConfig) -> Iterator[tuple[object, MegatronPlacement]]:
    """Build a real ``MoELayer`` for ``cfg`` in this rank; yield ``(layer, placement)``.

    Initializes Megatron's model-parallel state (with gloo groups) over the current
    torch.distributed world and destroys it on exit, even when the body raises, so the
    process can be reused for another topology. Every rank of the world must enter.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    if not dist.is_initialized():
        raise RuntimeError("megatron_moe_layer needs an initialized torch.distributed process group")
    world_size = dist.get_world_size()
    cfg.check(world_size)
    if cfg.expert_type == "te_grouped":
        import torch

        if not torch.cuda.is_available():
            raise MegatronTopologyError("expert_type='te_grouped' (TEGroupedMLP) needs CUDA")
    with model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        create_gloo_process_groups=True,
    ) as ps:
        layer = build_module(_module_spec(cfg), config=_transformer_config(cfg), layer_number=1)
        placement = MegatronPlacement(
            rank=dist.get_rank(),
            world_size=world_size,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            local_expert_indices=tuple(int(i) for i in layer.local_expert_indices),
        )
        yield layer, placement


def parse_expert_name(name: str) -> tuple[str, int | None, str]:
    """Split a Megatron expert parameter name into ``(kind, local_expert, projection)``.

    ``kind`` is ``"sequential"`` (``experts.local_experts.{i}.linear_fc1.weight``),
    ``"te_grouped"`` (``experts.linear_fc1.weight{i}``) or ``"te_stacked"`` (one
    ``experts.linear_fc1.weight`` holding every local expert; ``local_expert`` is None).
    Raises :class:`ExpertShardError` for anything else.
    """
    match = _SEQUENTIAL_NAME.match(name)
    if match:
        return "sequential", int(match.group(1)), match.group(2)
    match = _TE_GROUPED_NAME.match(name)
    if match:
        return "te_grouped", int(match.group(2)), match.group(1)
    match = _TE_STACKED_NAME.match(name)
    if match:
        return "te_stacked", None, match.group(1)
    raise ExpertShardError(f"{name!r} is not a Megatron expert weight name")


def expert_parameters(layer) -> tuple[ExpertParameter, ...]:
    """The layer's expert weights, in parameter order, read from the layer itself."""
    local_indices = tuple(int(i) for i in layer.local_expert_indices)
    found = []
    for name, param in layer.named_parameters():
        if not name.startswith("experts."):
            continue
        kind, local, projection = parse_expert_name(name)
        if local is None:
            raise ExpertShardError(f"{name!r}: stacked TE expert weights are not per-expert parameters")
        attrs = {attr: getattr(param, attr, None) for attr in _PARTITION_ATTRIBUTES}
        found.append(
            ExpertParameter(
                name=name,
                local_expert=local,
                global_expert=local_indices[local],
                projection=projection,
                shape=tuple(param.shape),
                dtype=str(param.dtype).removeprefix("torch."),
                tensor_model_parallel=attrs["tensor_model_parallel"],
                partition_dim=attrs["partition_dim"],
                partition_stride=attrs["partition_stride"],
                allreduce=attrs["allreduce"],
            )
        )
    return tuple(found)


def write_expert_shards(layer, shards: Mapping[str, object]) -> None:
    """Copy ``shards`` (parameter name -> tensor) into the layer's expert parameters in place.

    Every expert parameter must be given exactly once, with its exact shape and dtype; on any
    mismatch nothing is written and :class:`ExpertShardError` names the parameter.
    """
    import torch

    params = {name: p for name, p in layer.named_parameters() if name.startswith("experts.")}
    unknown = sorted(set(shards) - set(params))
    if unknown:
        raise ExpertShardError(f"shards name parameters the layer does not have: {unknown}")
    missing = sorted(set(params) - set(shards))
    if missing:
        raise ExpertShardError(f"shards miss expert parameters of the layer: {missing}")
    for name, value in shards.items():
        param = params[name]
        if not isinstance(value, torch.Tensor):
            raise ExpertShardError(f"shard {name!r} is a {type(value).__name__}, not a torch.Tensor")
        if tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype:
            raise ExpertShardError(
                f"shard {name!r} is {tuple(value.shape)} {value.dtype}; the layer holds "
                f"{tuple(param.shape)} {param.dtype}"
            )
    with torch.no_grad():
        for name, value in shards.items():
            params[name].copy_(value)


def read_expert_shards(layer) -> dict[str, object]:
    """The layer's expert parameters as a state dict of detached copies, by parameter name."""
    return {
        name: p.detach().clone()
        for name, p in layer.named_parameters()
        if name.startswith("experts.")
    }


def te_grouped_names(shards: Mapping[str, object]) -> dict[str, object]:
    """Rename SequentialMLP shards to TEGroupedMLP's naming (``experts.linear_fc1.weight{i}``).

    Shapes are the same in both (one ``[2F/etp, H]`` / ``[H, F/etp]`` tensor per local
    expert), so a state dict from one stands for the other; this is how the TEGroupedMLP
    naming is exercised where Transformer Engine is absent.
    """
    renamed = {}
    for name, value in shards.items():
        kind, local, projection = parse_expert_name(name)
        if kind != "sequential":
            raise ExpertShardError(f"{name!r} is not a SequentialMLP expert name")
        prefix = name[: name.index("experts.")]
        renamed[f"{prefix}experts.{projection}.weight{local}"] = value
    return renamed


# --------------------------------------------------------------------------------------------
# Megatron's own statement of where each shard belongs: the distributed-checkpoint metadata
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPiece:
    """One local expert tensor (or half of one) placed in Megatron's global checkpoint tensor.

    Produced by the layer's own ``sharded_state_dict`` (with ShardedTensorFactories built, so
    the gated fc1 appears as its gate and up halves with their own offsets). ``projection`` is
    ``linear_fc1`` (global ``[E, 2F, H]``, gate rows first) or ``linear_fc2`` (``[E, H, F]``).
    Only main replicas (``replica_id`` all zero) are returned.
    """

    projection: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    data: object


def checkpoint_pieces(layer) -> list[CheckpointPiece]:
    """The expert weights of ``layer`` as Megatron's checkpointing code places them."""
    return pieces_of_sharded_state_dict(layer.sharded_state_dict(prefix=""))


def pieces_of_sharded_state_dict(sharded) -> list[CheckpointPiece]:
    """Main-replica expert weight pieces of a Megatron sharded state dict (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    pieces = []
    for key, value in sharded.items():
        if ".linear_fc" not in key or not _WEIGHT_KEY.search(key):
            continue
        built = value.build() if isinstance(value, ShardedTensorFactory) else value
        for sh in built if isinstance(built, (list, tuple)) else [built]:
            if not isinstance(sh, ShardedTensor):
                raise ExpertShardError(f"{key!r}: expected ShardedTensor, got {type(sh).__name__}")
            replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
            if any(replica):
                continue
            projection = "linear_fc1" if sh.key.endswith("linear_fc1.weight") else "linear_fc2"
            pieces.append(
                CheckpointPiece(
                    projection=projection,
                    global_shape=tuple(sh.global_shape),
                    global_offset=tuple(sh.global_offset),
                    data=sh.data.detach().clone(),
                )
            )
    return pieces


def assemble_checkpoint(pieces) -> dict[str, object]:
    """Global ``{projection: tensor}`` from every rank's :func:`checkpoint_pieces`.

    Each element must be written by exactly one main-replica piece; a gap or an overlap
    raises :class:`ExpertShardError` naming the projection.
    """
    import torch

    out, counts = {}, {}
    for piece in pieces:
        shape = piece.global_shape
        if piece.projection not in out:
            out[piece.projection] = torch.zeros(shape, dtype=piece.data.dtype)
            counts[piece.projection] = torch.zeros(shape, dtype=torch.int32)
        if tuple(out[piece.projection].shape) != shape:
            raise ExpertShardError(
                f"{piece.projection}: pieces disagree on the global shape "
                f"({tuple(out[piece.projection].shape)} vs {shape})"
            )
        data = piece.data.reshape(piece.data.shape[-2:])
        index = (piece.global_offset[0],) + tuple(
            slice(o, o + n) for o, n in zip(piece.global_offset[1:], data.shape)
        )
        out[piece.projection][index] = data
        counts[piece.projection][index] += 1
    for projection, count in counts.items():
        if not bool((count == 1).all()):
            bad = tuple(int(i) for i in torch.nonzero(count != 1)[0])
            raise ExpertShardError(
                f"{projection}: element {bad} is covered {int(count[bad])} times by the "
                "main-replica checkpoint pieces (expected exactly once)"
            )
    return out


# --------------------------------------------------------------------------------------------
# TEGroupedMLP's naming, from Megatron-Core's own checkpoint code (without Transformer Engine)
# --------------------------------------------------------------------------------------------

#: Methods of ``TEGroupedLinear`` (megatron/core/extensions/transformer_engine.py) that turn the
#: TE parameters ``weight{i}`` of local GEMM ``i`` into sharded-state-dict entries placed at
#: global expert ``ep_rank * num_gemms + i``. The class only exists where Transformer Engine
#: imports; these two methods use nothing from TE, so they are compiled from the installed source.
_TE_GROUPED_METHODS = ("_sharded_state_dict_grouped", "_split_extra_state")


def _te_grouped_linear_methods() -> dict:
    import ast
    import inspect
    import textwrap

    from megatron.core.extensions import transformer_engine as te_ext

    tree = ast.parse(inspect.getsource(te_ext))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "TEGroupedLinear":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in _TE_GROUPED_METHODS:
                    source = textwrap.dedent(ast.get_source_segment(inspect.getsource(te_ext), item))
                    namespace = dict(vars(te_ext))
                    exec(compile(source, te_ext.__file__, "exec"), namespace)  # noqa: S102 - installed Megatron source
                    found[item.name] = namespace[item.name]
    missing = set(_TE_GROUPED_METHODS) - set(found)
    if missing:
        raise ExpertShardError(
            f"megatron-core's TEGroupedLinear no longer defines {sorted(missing)}; update te_grouped_sharded_state_dict"
        )
    return found


class _GroupedLinearState:
    """The state a ``TEGroupedLinear`` holds for the checkpoint code: ``weight{i}`` per local
    GEMM, the expert-TP group, the EP / expert-DP groups, and an fp8-free ``_extra_state``."""

    def __init__(self, weights, axis, tp_group, pg_collection, methods):
        self._weights = list(weights)
        self._axis = axis
        self.num_gemms = len(self._weights)
        self._tp_group = tp_group
        self._pg_collection = pg_collection
        self.use_bias = False
        self.fp8_meta = {"fp8_checkpoint": False}
        self.fp8 = self.fp8_calibration = False
        self._methods = methods

    def state_dict(self, prefix="", keep_vars=False):
        out = {f"{prefix}weight{i}": w for i, w in enumerate(self._weights)}
        out[f"{prefix}_extra_state"] = None
        return out

    def _split_extra_state(self, state):
        return self._methods["_split_extra_state"](self, state)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # TEColumnParallelGroupedLinear / TERowParallelGroupedLinear: weight split along 0 / 1.
        tp_axis_map = {f"{i}.weight": self._axis for i in range(self.num_gemms)}
        return self._methods["_sharded_state_dict_grouped"](self, tp_axis_map, prefix, sharded_offsets, metadata)


def te_grouped_sharded_state_dict(layer, grouped_weights) -> dict:
    """Megatron-Core's TEGroupedMLP checkpoint entries for ``grouped_weights`` in this rank.

    ``grouped_weights`` maps TEGroupedMLP names (``experts.linear_fc1.weight{i}``,
    ``experts.linear_fc2.weight{i}``) to this rank's tensors. They are handed to the real
    ``TEGroupedMLP.sharded_state_dict`` (megatron/core/transformer/moe/experts.py: the SwiGLU
    factory of fc1, the prefixes) over stand-ins for its two ``TEGroupedLinear`` modules that run
    the real ``_sharded_state_dict_grouped`` (key ``weight{i}``, global expert offset). Returns
    the sharded state dict; :func:`pieces_of_sharded_state_dict` and
    :func:`assemble_checkpoint` place it. ``layer`` is a built SequentialMLP ``MoELayer`` of the
    same topology (for the config and process groups); must run inside
    :func:`megatron_moe_layer`.
    """
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    experts = layer.experts
    methods = _te_grouped_linear_methods()
    fc = {1: {}, 2: {}}
    for name, tensor in grouped_weights.items():
        kind, local, projection = parse_expert_name(name)
        if kind != "te_grouped":
            raise ExpertShardError(f"{name!r} is not a TEGroupedMLP expert name")
        fc[int(projection[-1])][local] = tensor
    for number, weights in fc.items():
        if sorted(weights) != list(range(experts.num_local_experts)):
            raise ExpertShardError(
                f"linear_fc{number}: TEGroupedMLP weights {sorted(weights)} do not cover local experts "
                f"0..{experts.num_local_experts - 1}"
            )
    pg = types.SimpleNamespace(ep=experts.ep_group, expt_dp=ps.get_expert_data_parallel_group(), expt_tp=experts.tp_group)
    standin = types.SimpleNamespace(
        _modules={
            "linear_fc1": _GroupedLinearState([fc[1][i] for i in sorted(fc[1])], 0, experts.tp_group, pg, methods),
            "linear_fc2": _GroupedLinearState([fc[2][i] for i in sorted(fc[2])], 1, experts.tp_group, pg, methods),
        },
        config=experts.config,
        ep_group=experts.ep_group,
        tp_group=experts.tp_group,
        num_local_experts=experts.num_local_experts,
    )
    return TEGroupedMLP.sharded_state_dict(standin, prefix="experts.", sharded_offsets=(), metadata=None)
