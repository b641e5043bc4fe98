"""The trainer side of a whole model: which Megatron-Core shard holds which checkpoint rows.

Every checkpoint tensor of a :class:`~pytest_weightsync.reference_impl.model.model_spec.ModelSpec`
lives in a Megatron-Core ``GPTModel`` (a ``MambaModel``-style hybrid for Qwen3.5's GDN
layers) under the name Megatron-Bridge maps it from (``models/qwen/qwen3_next_bridge.py``,
``qwen3_moe_bridge.py``: the Transformer Engine spec, whose input layer norm is fused into
``linear_qkv`` / ``in_proj`` as ``layer_norm_weight``), on one pipeline stage (contiguous
layers numbered from 0 on each stage, :func:`~pytest_weightsync.reference_impl.model.layout.
stage_layers` of them - uneven with ``first_stage_layers``; the embedding on the first stage; the final norm, the
output layer and the MTP block on the last), sharded over the dense TP group by one of
:data:`KINDS`:

``replicated``     every TP rank holds the whole tensor (norms, the router, its expert bias,
                   the shared expert's gate);
``column``         rank ``t`` holds rows ``[t * n/tp, (t + 1) * n/tp)`` (``A_log``, ``dt_bias``,
                   the MTP ``eh_proj``);
``row``            rank ``t`` holds that run of columns (``linear_proj``, ``out_proj``,
                   the shared expert's ``linear_fc2``);
``components``     the tensor stacks components, each sharded on its own: rank ``t`` holds
                   ``[c0_t; c1_t; ...]`` (GDN ``in_proj = [q; k; v; z; b; a]``, ``conv1d =
                   [q; k; v]``, the shared expert's ``linear_fc1 = [gate; up]``): the gather
                   is component-major (:mod:`~pytest_weightsync.reference_impl.trainer.component_gather`);
``query_groups``   ``linear_qkv`` interleaved per query group - ``[q_g; k_g; v_g]``, with the
                   attention output gate ``[q_g; gate_g; k_g; v_g]`` (``SelfAttention.
                   get_query_key_value_tensors``) - and split into contiguous dim-0 runs;
                   the checkpoint's gated ``q_proj`` holds ``[q_h; gate_h]`` per head
                   (transformers ``Qwen3_5MoeAttention``);
``vocab``          the vocabulary padded to a multiple of ``128 * tp`` (Megatron-LM's
                   ``make_vocab_size_divisible_by``), contiguous rows per rank; the padding
                   rows hold training garbage an exporter must drop.

With tied embeddings and PP > 1 the last stage holds ``output_layer.weight`` as a copy of the
embedding (Megatron's shared embedding): the checkpoint has one source, so an exporter that
sends both names sends it twice. With an MTP block and PP > 1 its (last) stage holds its own
copy of the embedding as well (``GPTModel.mtp_process``; tied, that copy is the head the stage
uses and its ``output_layer.weight`` is allocated but unused: ``TrainerParam.unused``, filled
with garbage as an initialised, never-read parameter is). The routed experts follow
:mod:`~pytest_weightsync.reference_impl.trainer.trainer` (EP / ETP over the expert groups).

This is the oracle real-Megatron trainer tests hold a ``GPTModel``'s parameters to; the
single-process exporter suite builds its trainer states from it (:func:`trainer_model_state`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

import torch

from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.trainer.component_gather import (
    ComponentLayout,
    assemble_components,
    interleave_qkv,
    shard_of,
    split_megatron_qkv,
)
from pytest_weightsync.reference_impl.model.layout import (
    TrainerTopology,
    stage_layers,
    trainer_shard,
)
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, hf_params, layer_prefix
from pytest_weightsync.reference_impl.model.model_spec import ModelWeights

#: The word embedding's Megatron name (on the first stage; copies elsewhere).
EMBEDDING = "embedding.word_embeddings.weight"
KINDS = ("replicated", "column", "row", "components", "query_groups", "vocab")
#: Megatron-LM's default ``--make-vocab-size-divisible-by``.
VOCAB_DIVISOR = 128


class Block(NamedTuple):
    """Rows ``[start, start + size)`` of checkpoint tensor ``source`` (one component)."""

    source: str
    start: int
    size: int


class TrainerParam(NamedTuple):
    """One Megatron parameter (or buffer) of a pipeline stage and what it holds."""

    name: str
    stage: int
    kind: str
    blocks: tuple       # the checkpoint rows it stacks, in order
    dtype: torch.dtype
    layer: object       # (target, layer inside the target) or None
    unused: bool = False  # allocated but never read: it holds its initial values


def padded_vocab(vocab: int, tp: int) -> int:
    unit = VOCAB_DIVISOR * tp
    return -(-vocab // unit) * unit


def validate_trainer_model(spec: ModelSpec, topo: TrainerTopology) -> None:
    tp = topo.tp
    stage_layers(spec.num_layers, topo)  # validates the pipeline split
    for what, rows in (("linear_qkv rows", spec.q_rows + 2 * spec.kv_rows),
                       ("attention output columns", spec.num_heads * spec.head_dim)):
        _require(rows % tp == 0, f"{what} must divide by the trainer's tp", rows=rows, tp=tp)
    if spec.family_record.gdn:
        for what, n in (("GDN key channels", spec.gdn_qk), ("GDN value channels", spec.gdn_v),
                        ("GDN value heads", spec.linear_v_heads),
                        ("shared expert FFN", spec.intermediate_shared), ("hidden", spec.hidden)):
            _require(n % tp == 0, f"{what} must divide by the trainer's tp", size=n, tp=tp)


def _layer_params(spec: ModelSpec, target: str, layer: int, name_prefix: str, stage: int):
    hp = layer_prefix(target, layer)
    bf = spec.dtype
    cat = hf_params(spec)
    out = []

    def add(name, kind, blocks, dtype=bf):
        out.append(TrainerParam(f"{name_prefix}.{name}", stage, kind, tuple(blocks), dtype,
                                (target, layer)))

    def whole(suffix):
        name = f"{hp}.{suffix}"
        return (Block(name, 0, cat[name].shape[0]),)

    kind = spec.layer_kind(layer) if target == "target" else "attention"
    if kind == "attention":
        add("self_attention.linear_qkv.layer_norm_weight", "replicated", whole("input_layernorm.weight"))
        add("self_attention.linear_qkv.weight", "query_groups",
            whole("self_attn.q_proj.weight") + whole("self_attn.k_proj.weight")
            + whole("self_attn.v_proj.weight"))
        add("self_attention.linear_proj.weight", "row", whole("self_attn.o_proj.weight"))
        add("self_attention.q_layernorm.weight", "replicated", whole("self_attn.q_norm.weight"))
        add("self_attention.k_layernorm.weight", "replicated", whole("self_attn.k_norm.weight"))
    else:
        qk, v = spec.gdn_qk, spec.gdn_v
        qkv = f"{hp}.linear_attn.in_proj_qkv.weight"
        conv = f"{hp}.linear_attn.conv1d.weight"
        add("self_attention.in_proj.layer_norm_weight", "replicated", whole("input_layernorm.weight"))
        add("self_attention.in_proj.weight", "components",
            (Block(qkv, 0, qk), Block(qkv, qk, qk), Block(qkv, 2 * qk, v))
            + whole("linear_attn.in_proj_z.weight") + whole("linear_attn.in_proj_b.weight")
            + whole("linear_attn.in_proj_a.weight"))
        add("self_attention.conv1d.weight", "components",
            (Block(conv, 0, qk), Block(conv, qk, qk), Block(conv, 2 * qk, v)))
        add("self_attention.A_log", "column", whole("linear_attn.A_log"), torch.float32)
        add("self_attention.dt_bias", "column", whole("linear_attn.dt_bias"))
        add("self_attention.out_norm.weight", "replicated", whole("linear_attn.norm.weight"))
        add("self_attention.out_proj.weight", "row", whole("linear_attn.out_proj.weight"))
    add("pre_mlp_layernorm.weight", "replicated", whole("post_attention_layernorm.weight"))
    add("mlp.router.weight", "replicated", whole("mlp.gate.weight"), spec.router_dtype)
    if spec.expert_bias:
        # a buffer (register_buffer), in state_dict() but not in named_parameters()
        add("mlp.router.expert_bias", "replicated", whole("mlp.gate.e_score_correction_bias"),
            torch.float32)
    if spec.intermediate_shared:
        add("mlp.shared_experts.linear_fc1.weight", "components",
            whole("mlp.shared_expert.gate_proj.weight") + whole("mlp.shared_expert.up_proj.weight"))
        add("mlp.shared_experts.linear_fc2.weight", "row", whole("mlp.shared_expert.down_proj.weight"))
        add("mlp.shared_experts.gate_weight", "replicated", whole("mlp.shared_expert_gate.weight"))
    return out


def trainer_params(spec: ModelSpec, topo: TrainerTopology) -> list[TrainerParam]:
    """Every non-expert Megatron parameter of the model, on its stage, local numbering."""
    validate_trainer_model(spec, topo)
    last, stages = topo.pp - 1, stage_layers(spec.num_layers, topo)
    cat = hf_params(spec)

    def whole(name):
        return (Block(name, 0, cat[name].shape[0]),)

    out = [TrainerParam(EMBEDDING, 0, "vocab",
                        whole("model.embed_tokens.weight"), spec.dtype, None)]
    for layer in range(spec.num_layers):
        stage = next(s for s, layers in enumerate(stages) if layer in layers)
        local = layer - stages[stage].start
        out += _layer_params(spec, "target", layer, f"decoder.layers.{local}", stage)
    out.append(TrainerParam("decoder.final_layernorm.weight", last, "replicated",
                            whole("model.norm.weight"), spec.dtype, None))
    if not spec.tied:
        out.append(TrainerParam("output_layer.weight", last, "vocab", whole("lm_head.weight"),
                                spec.dtype, None))
    elif topo.pp > 1:  # Megatron's shared embedding: a copy on the last stage
        # ... unless the MTP block's embedding copy is there: that is the head the stage
        # uses (GPTModel.shared_embedding_or_output_weight), output_layer's own weight only
        # allocated (pre_process is False) and never read
        out.append(TrainerParam("output_layer.weight", last, "vocab",
                                whole("model.embed_tokens.weight"), spec.dtype, None,
                                unused=bool(spec.mtp_layers)))
    if spec.mtp_layers and topo.pp > 1:
        # the MTP block embeds the shifted tokens: GPTModel builds an embedding on its stage
        # too (``mtp_process``), all-reduced from the first stage's over the embedding group
        out.append(TrainerParam(EMBEDDING, last, "vocab", whole("model.embed_tokens.weight"),
                                spec.dtype, None))
    for layer in range(spec.mtp_layers):
        m = f"mtp.layers.{layer}"
        out.append(TrainerParam(f"{m}.eh_proj.weight", last, "column", whole("mtp.fc.weight"),
                                spec.dtype, ("draft", layer)))
        for own, hf in (("enorm", "mtp.pre_fc_norm_embedding.weight"),
                        ("hnorm", "mtp.pre_fc_norm_hidden.weight"),
                        ("final_layernorm", "mtp.norm.weight")):
            out.append(TrainerParam(f"{m}.{own}.weight", last, "replicated", whole(hf),
                                    spec.dtype, ("draft", layer)))
        out += _layer_params(spec, "draft", layer, f"{m}.transformer_layer", last)
    return out


def is_embedding_copy(spec: ModelSpec, name: str, stage: int) -> bool:
    """Whether Megatron parameter ``name`` (local-spec name, wrappers removed) on pipeline
    stage ``stage`` is not a checkpoint tensor of its own: a copy of the first stage's
    embedding - a tied model's ``output_layer``, the embedding of the MTP block's stage (PP >
    1); an exporter that sends it sends the embedding twice (NeMo-RL#2471). Tied with an MTP
    block on a later stage, that stage's ``output_layer.weight`` is not even a copy: it is
    never read and holds initialisation garbage (``TrainerParam.unused``)."""
    return (spec.tied and name == "output_layer.weight") or (name == EMBEDDING and stage > 0)


def is_shared_embedding_copy(spec: ModelSpec, param: TrainerParam) -> bool:
    """:func:`is_embedding_copy` of a :class:`TrainerParam`."""
    return is_embedding_copy(spec, param.name, param.stage)


def trainer_param_shapes(spec: ModelSpec, topo: TrainerTopology, rank: int) -> dict:
    """``{Megatron name: (shape, dtype)}`` of every non-expert parameter (and the expert-bias
    buffer) trainer rank ``rank`` holds: what a real ``GPTModel`` of ``spec`` on ``topo``
    must hold (local layer numbering), for checks of a real model's ``named_parameters()`` /
    ``state_dict()`` against this oracle."""
    cat = hf_params(spec)
    stage = trainer_shard(spec.experts, topo, rank).pp_rank
    out = {}
    for param in trainer_params(spec, topo):
        if param.stage != stage:
            continue
        rows = sum(b.size for b in param.blocks)
        rest = tuple(cat[param.blocks[0].source].shape[1:])
        if param.kind == "vocab":
            rows = padded_vocab(rows, topo.tp)
        if param.kind == "row":
            shape = (rows, rest[0] // topo.tp, *rest[1:])
        elif param.kind == "replicated":
            shape = (rows, *rest)
        else:
            shape = (rows // topo.tp, *rest)
        out[param.name] = (shape, param.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Shards from full tensors, and back
# --------------------------------------------------------------------------------------------


def _gated_qkv(spec: ModelSpec, q, k, v):
    """Megatron's per-group ``[q_g; gate_g; k_g; v_g]`` from a gated ``q_proj``."""
    d, groups = spec.head_dim, spec.num_kv_heads
    per = spec.num_heads // groups
    rest = tuple(q.shape[1:])
    heads = q.reshape(spec.num_heads, 2, d, *rest)
    qg = heads[:, 0].reshape(groups, per * d, *rest)
    gg = heads[:, 1].reshape(groups, per * d, *rest)
    return torch.cat([qg, gg, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_gated_qkv(spec: ModelSpec, qkv):
    d, groups = spec.head_dim, spec.num_kv_heads
    per = spec.num_heads // groups
    rest = tuple(qkv.shape[1:])
    g = qkv.reshape(groups, (2 * per + 2) * d, *rest)
    qg, gg, k, v = torch.split(g, [per * d, per * d, d, d], dim=1)
    q = torch.stack([qg.reshape(spec.num_heads, d, *rest), gg.reshape(spec.num_heads, d, *rest)],
                    dim=1).reshape(-1, *rest)
    return q, k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layout(param: TrainerParam) -> ComponentLayout:
    return ComponentLayout(param.name, tuple(f"c{i}" for i in range(len(param.blocks))),
                           tuple(b.size for b in param.blocks))


def _poisoned_vocab_table(table: torch.Tensor, tp: int, *, seed: int) -> torch.Tensor:
    """A tensor of ``table``'s shape with its rows padded to Megatron's vocabulary
    (:func:`padded_vocab`), every element the poison pattern of ``seed``."""
    out = torch.empty((padded_vocab(table.shape[0], tp), *table.shape[1:]), dtype=table.dtype)
    return synth.poison_(out, seed=seed)


def full_tensor(spec: ModelSpec, param: TrainerParam, dense: dict, tp: int, seed: int = 0):
    """The unsharded Megatron tensor of ``param`` from the checkpoint tensors ``dense``
    (vocab padding: the poison pattern, which no engine may receive)."""
    parts = [dense[b.source].narrow(0, b.start, b.size) for b in param.blocks]
    if param.unused:  # never read by the model, never trained: not the checkpoint's values
        (table,) = parts
        return _poisoned_vocab_table(table, tp, seed=0xDEAD)
    if param.kind == "query_groups":
        q, k, v = parts
        if spec.attn_output_gate:
            return _gated_qkv(spec, q, k, v)
        return interleave_qkv(q, k, v, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if param.kind == "vocab":
        (table,) = parts
        out = _poisoned_vocab_table(table, tp, seed=0xE1B)
        out[:table.shape[0]] = table
        return out
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def shard(param: TrainerParam, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``param``'s unsharded tensor ``full``."""
    if param.kind == "replicated":
        return full.clone()
    if param.kind == "row":
        n = full.shape[1] // tp
        return full[:, tp_rank * n:(tp_rank + 1) * n].contiguous()
    if param.kind == "components":
        return shard_of(full, _layout(param), tp, tp_rank).contiguous()
    n = full.shape[0] // tp
    return full[tp_rank * n:(tp_rank + 1) * n].clone()


def unshard(param: TrainerParam, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The unsharded tensor from every TP rank's shard, in TP rank order."""
    if param.kind == "replicated":
        return shards[0]
    if param.kind == "row":
        return torch.cat(list(shards), dim=1)
    if param.kind == "components":
        return assemble_components(shards, _layout(param))
    return torch.cat(list(shards), dim=0)


def checkpoint_tensors(spec: ModelSpec, param: TrainerParam, full: torch.Tensor) -> dict:
    """``{checkpoint name: tensor}`` held by ``param``'s unsharded tensor ``full``."""
    if param.kind == "query_groups":
        split = (_split_gated_qkv(spec, full) if spec.attn_output_gate else
                 split_megatron_qkv(full, spec.num_heads, spec.num_kv_heads, spec.head_dim))
        return {b.source: t for b, t in zip(param.blocks, split)}
    if param.kind == "vocab":
        (block,) = param.blocks
        return {block.source: full[:block.size]}
    out, offset = {}, 0
    for b in param.blocks:
        piece = full.narrow(0, offset, b.size)
        out.setdefault(b.source, []).append(piece)
        offset += b.size
    return {name: torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            for name, pieces in out.items()}


def _stage_topology(topo: TrainerTopology) -> TrainerTopology:
    """The expert layout of one stage (the draft's MTP layers all live on the last one)."""
    return replace(topo, pp=1, first_stage_layers=None)


def _draft_expert_name(name: str) -> str:
    head, _, rest = name.partition("decoder.layers.")
    layer, _, tail = rest.partition(".")
    return f"mtp.layers.{layer}.transformer_layer.{tail}"


def trainer_model_state(spec: ModelSpec, topo: TrainerTopology, rank: int,
                        weights: ModelWeights, seed: int = 0) -> dict:
    """Trainer rank ``rank``'s whole state dict (parameters and the router's expert-bias
    buffer) under Megatron names, sliced from the checkpoint ``weights``."""
    where = trainer_shard(spec.experts, topo, rank)
    state = {}
    for param in trainer_params(spec, topo):
        if param.stage == where.pp_rank:
            full = full_tensor(spec, param, weights.dense, topo.tp, seed)
            state[param.name] = shard(param, full, topo.tp, where.tp_rank)
    state.update(trainer.trainer_state(spec.experts, topo, rank, weights.experts["target"]))
    if spec.mtp_layers and where.pp_rank == topo.pp - 1:
        stage = _stage_topology(topo)
        local = rank - where.pp_rank * topo.stage_size
        draft = trainer.trainer_state(spec.draft_experts, stage, local, weights.experts["draft"])
        state.update({_draft_expert_name(n): t for n, t in draft.items()})
    return state


def trainer_model_states(spec: ModelSpec, topo: TrainerTopology, weights: ModelWeights) -> list:
    """Every trainer rank's whole state dict, in rank order."""
    return [trainer_model_state(spec, topo, r, weights) for r in range(topo.world_size)]


def gather_model(spec: ModelSpec, topo: TrainerTopology, states: Sequence[dict]) -> ModelWeights:
    """The checkpoint back from every trainer rank's state (single process): each parameter
    from its stage's TP ranks (data-parallel replica 0), the experts through the expert
    gather. A tied model's last-stage embedding copy is not read."""
    dense = {}
    for param in trainer_params(spec, topo):
        if is_shared_embedding_copy(spec, param):
            continue
        ranks = [param.stage * topo.stage_size + t for t in range(topo.tp)]
        missing = [r for r in ranks if param.name not in states[r]]
        if missing:
            raise trainer.TrainerStateError(f"trainer rank {missing[0]} has no parameter "
                                            f"{param.name!r}")
        full = unshard(param, [states[r][param.name] for r in ranks])
        dense.update(checkpoint_tensors(spec, param, full))
    experts = {"target": trainer.gather_full_weights(spec.experts, topo, states)}
    if spec.mtp_layers:
        stage = _stage_topology(topo)
        first = (topo.pp - 1) * topo.stage_size
        renamed = [{n.replace("mtp.layers.", "decoder.layers.").replace(".transformer_layer", ""): t
                    for n, t in states[first + r].items() if n.startswith("mtp.layers.")}
                   for r in range(topo.stage_size)]
        experts["draft"] = trainer.gather_full_weights(spec.draft_experts, stage, renamed)
    order = list(hf_params(spec))
    return ModelWeights({name: dense[name] for name in order}, experts)
