"""Where every checkpoint row lands in an SGLang engine rank: the whole-model receiver layout.

:mod:`~pytest_weightsync.reference_impl.model.layout` answers it for the routed experts
(``FusedMoE``); this module answers it for every other parameter, with the TP slicing of the
SGLang 0.5.23 layer that holds it, so the receiver, the direct sender, the expected state and
the element locator all read one table:

* ``QKVParallelLinear`` (``qkv_proj``): rank ``r`` holds ``[q_r; k_r; v_r]``, ``q_r`` its
  ``1/tp`` of the query rows; with fewer KV heads than TP ranks each KV head is replicated on
  ``tp / kv_heads`` consecutive ranks (``weight_loader``: ``shard_id = tp_rank //
  num_kv_head_replicas``);
* ``MergedColumnParallelLinear`` (``shared_expert.gate_up_proj = [gate_r; up_r]``, GDN
  ``in_proj_qkvz = [q_r; k_r; v_r; z_r]`` from ``in_proj_qkv`` (shard ids ``(0, 1, 2)``) and
  ``in_proj_z``, ``in_proj_ba = [b_r; a_r]``): component by component, never an even split of
  the concatenation;
* ``mamba_v2_sharded_weight_loader`` (GDN ``conv1d``, ``[q_r; k_r; v_r]``) and
  ``sharded_weight_loader(0)`` (``A_log``, ``dt_bias``: a contiguous ``1/tp``);
* ``RowParallelLinear`` (``o_proj``, GDN ``out_proj``, ``shared_expert.down_proj``): columns;
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64
  (of ``64 * tp`` when that is not divisible by ``tp``), ``padded / tp`` rows per rank, rows
  past the real vocabulary zero-filled (``weight_loader``); a tied ``lm_head`` is filled from
  ``embed_tokens`` (``Qwen3_5MoeForConditionalGeneration.load_weights``);
* replicated: norms, the router ``mlp.gate`` (``ReplicatedLinear``), ``shared_expert_gate``
  (``nn.Linear``), the draft's ``fc`` (``nn.Linear``) and pre-fc norms, and the modelled
  float32 ``e_score_correction_bias``.

An engine parameter is a concatenation, along one axis, of :class:`Segment` s: a run of a
checkpoint tensor's rows (or columns) or zero padding. The engine's names are SGLang's
(``Qwen3MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration``: Qwen3.5's attention layers
hold ``qkv_proj`` directly, without ``self_attn`` - the family record's
``sglang_attention_prefix``, :mod:`.families`); the draft (``Qwen3_5ForCausalLMMTP``) is a
second model, addressed here with the prefix :data:`DRAFT_PREFIX`. Its ``embed_tokens`` and
``lm_head`` are the served model's tensors (SGLang's speculative worker calls
``set_embed_and_head``), so they are not draft parameters. With tied embeddings the engine
here holds ``lm_head`` as a buffer of its own (as SGLang's last pipeline stage does): the
checkpoint's one ``embed_tokens`` must reach both.

Attention TP is the engine's TP size: engines with MoE-DP > 1 (attention context parallelism)
are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

import torch

from pytest_weightsync.reference_impl.model.layout import (
    ReceiverTopology,
    TopologyError,
    fused_name,
    receiver_param_shapes,
)
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, hf_params, layer_prefix

#: Prefix of the draft model's engine parameter names (``draft.fc.weight``,
#: ``draft.model.layers.0.qkv_proj.weight``): SGLang holds the draft as a model of its own.
DRAFT_PREFIX = "draft."
#: SGLang's ``DEFAULT_VOCAB_PADDING_SIZE`` (``layers/vocab_parallel_embedding.py``).
VOCAB_PADDING = 64


class Segment(NamedTuple):
    """A run of ``size`` indices along the parameter's axis: ``source``'s indices
    ``[start, start + size)``, or zeros when ``source`` is ``None`` (vocabulary padding)."""

    source: Optional[str]
    start: int
    size: int


class EngineParam(NamedTuple):
    """One parameter of an engine rank. ``segments`` concatenate along ``axis``; the other
    dimensions are the source's whole. Routed-expert parameters (``part == "experts"``) have no
    segments: :mod:`~pytest_weightsync.reference_impl.model.layout` places them."""

    name: str
    shape: tuple
    dtype: torch.dtype
    axis: int
    segments: tuple
    part: str
    target: str
    layer: Optional[int]


def engine_name(target: str, name: str) -> str:
    """The engine name of a ``target`` model's parameter ``name``."""
    return name if target == "target" else DRAFT_PREFIX + name


def split_engine_name(name: str) -> tuple[str, str]:
    """``(target, the model's own parameter name)`` of an engine name."""
    if name.startswith(DRAFT_PREFIX):
        return "draft", name[len(DRAFT_PREFIX):]
    return "target", name


def validate_engine(spec: ModelSpec, topo: ReceiverTopology) -> None:
    """Raise :class:`TopologyError` for an engine SGLang cannot shard this model on."""
    tp = topo.tp
    _require(topo.moe_dp == 1, "whole-model engines are modelled with attention TP = TP "
             "(moe_dp 1); MoE-DP > 1 (attention context parallelism) is not modelled",
             moe_dp=topo.moe_dp)
    _require(spec.q_rows // spec.head_dim % tp == 0,
             "query heads (with the output gate: 2 per head) must divide by the engine's TP "
             "size (QKVParallelLinear)", heads=spec.q_rows // spec.head_dim, tp=tp)
    _require(spec.num_kv_heads % tp == 0 or tp % spec.num_kv_heads == 0,
             "KV heads must divide by TP or TP by KV heads (QKVParallelLinear replicates KV "
             "heads when there are fewer than TP ranks)", num_kv_heads=spec.num_kv_heads, tp=tp)
    if spec.intermediate_shared:
        _require(spec.intermediate_shared % tp == 0,
                 "the shared expert's FFN size must divide by TP (MergedColumnParallelLinear)",
                 intermediate_shared=spec.intermediate_shared, tp=tp)
    if spec.family_record.gdn:
        _require(spec.linear_k_heads % tp == 0 and spec.linear_v_heads % tp == 0,
                 "GDN key and value heads must divide by TP", linear_k_heads=spec.linear_k_heads,
                 linear_v_heads=spec.linear_v_heads, tp=tp)


@dataclass(frozen=True)
class VocabShard:
    """A rank's rows of ``embed_tokens`` / ``lm_head``: checkpoint rows ``[start, start +
    real)``, then ``rows - real`` zero rows."""

    start: int
    real: int
    rows: int


def vocab_shard(vocab: int, tp: int, rank: int) -> VocabShard:
    """SGLang's ``VocabParallelEmbedding`` sharding of a ``vocab``-row table (no added
    tokens): pad to a multiple of 64, or of ``64 * tp`` when that is not divisible by ``tp``."""
    padding = VOCAB_PADDING
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    padded = -(-vocab // padding) * padding
    rows = padded // tp
    start = min(rank * rows, vocab)
    return VocabShard(start, min(rows * (rank + 1), vocab) - start, rows)


def _whole(name: str, shape: tuple) -> tuple:
    return (Segment(name, 0, shape[0]),)


def _slice(name: str, full: int, tp: int, rank: int, offset: int = 0) -> Segment:
    """Rank ``rank``'s ``1/tp`` of ``full`` indices starting at ``offset`` of ``name``."""
    size = full // tp
    return Segment(name, offset + rank * size, size)


def _kv_segment(spec: ModelSpec, name: str, tp: int, rank: int) -> Segment:
    if spec.num_kv_heads >= tp:
        return _slice(name, spec.kv_rows, tp, rank)
    replicas = tp // spec.num_kv_heads
    return Segment(name, (rank // replicas) * spec.head_dim, spec.head_dim)


def _layer(spec: ModelSpec, target: str, layer: int, tp: int, rank: int) -> list[EngineParam]:
    hp = layer_prefix(target, layer)
    own = f"model.layers.{layer}"
    H = spec.hidden
    catalogue = hf_params(spec)
    out = []

    def add(name, shape, axis, segments, part, dtype=spec.dtype):
        out.append(EngineParam(engine_name(target, f"{own}.{name}"), tuple(shape), dtype, axis,
                               tuple(segments), part, target, layer))

    def hf(suffix):
        return f"{hp}.{suffix}"

    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        add(norm, (H,), 0, _whole(hf(norm), (H,)), "norms")
    kind = spec.layer_kind(layer) if target == "target" else "attention"
    if kind == "attention":
        attn = spec.family_record.sglang_attention_prefix
        q = _slice(hf("self_attn.q_proj.weight"), spec.q_rows, tp, rank)
        k = _kv_segment(spec, hf("self_attn.k_proj.weight"), tp, rank)
        v = _kv_segment(spec, hf("self_attn.v_proj.weight"), tp, rank)
        add(f"{attn}qkv_proj.weight", (q.size + k.size + v.size, H), 0, (q, k, v), "attention")
        cols = spec.num_heads * spec.head_dim
        add(f"{attn}o_proj.weight", (H, cols // tp), 1,
            (_slice(hf("self_attn.o_proj.weight"), cols, tp, rank),), "attention")
        for norm in ("q_norm", "k_norm"):
            add(f"{attn}{norm}.weight", (spec.head_dim,), 0,
                _whole(hf(f"self_attn.{norm}.weight"), (spec.head_dim,)), "attention")
    else:
        qk, v, nv, K = spec.gdn_qk, spec.gdn_v, spec.linear_v_heads, spec.conv_kernel
        qkv = hf("linear_attn.in_proj_qkv.weight")
        segs = (_slice(qkv, qk, tp, rank), _slice(qkv, qk, tp, rank, qk),
                _slice(qkv, v, tp, rank, 2 * qk), _slice(hf("linear_attn.in_proj_z.weight"), v, tp, rank))
        add("linear_attn.in_proj_qkvz.weight", ((2 * qk + 2 * v) // tp, H), 0, segs, "gdn")
        segs = (_slice(hf("linear_attn.in_proj_b.weight"), nv, tp, rank),
                _slice(hf("linear_attn.in_proj_a.weight"), nv, tp, rank))
        add("linear_attn.in_proj_ba.weight", (2 * nv // tp, H), 0, segs, "gdn")
        conv = hf("linear_attn.conv1d.weight")
        segs = (_slice(conv, qk, tp, rank), _slice(conv, qk, tp, rank, qk),
                _slice(conv, v, tp, rank, 2 * qk))
        add("linear_attn.conv1d.weight", ((2 * qk + v) // tp, 1, K), 0, segs, "gdn")
        add("linear_attn.A_log", (nv // tp,), 0, (_slice(hf("linear_attn.A_log"), nv, tp, rank),),
            "gdn", torch.float32)
        add("linear_attn.dt_bias", (nv // tp,), 0,
            (_slice(hf("linear_attn.dt_bias"), nv, tp, rank),), "gdn")
        add("linear_attn.norm.weight", (spec.linear_v_dim,), 0,
            _whole(hf("linear_attn.norm.weight"), (spec.linear_v_dim,)), "gdn")
        add("linear_attn.out_proj.weight", (H, v // tp), 1,
            (_slice(hf("linear_attn.out_proj.weight"), v, tp, rank),), "gdn")
    add("mlp.gate.weight", (spec.num_experts, H), 0,
        _whole(hf("mlp.gate.weight"), (spec.num_experts,)), "router", spec.router_dtype)
    if spec.expert_bias:
        add("mlp.gate.e_score_correction_bias", (spec.num_experts,), 0,
            _whole(hf("mlp.gate.e_score_correction_bias"), (spec.num_experts,)), "expert_bias",
            torch.float32)
    if spec.intermediate_shared:
        Is = spec.intermediate_shared
        segs = (_slice(hf("mlp.shared_expert.gate_proj.weight"), Is, tp, rank),
                _slice(hf("mlp.shared_expert.up_proj.weight"), Is, tp, rank))
        add("mlp.shared_expert.gate_up_proj.weight", (2 * Is // tp, H), 0, segs, "shared_expert")
        add("mlp.shared_expert.down_proj.weight", (H, Is // tp), 1,
            (_slice(hf("mlp.shared_expert.down_proj.weight"), Is, tp, rank),), "shared_expert")
        add("mlp.shared_expert_gate.weight", (1, H), 0,
            _whole(hf("mlp.shared_expert_gate.weight"), (1,)), "shared_expert")
    for p in out:
        for seg in p.segments:
            assert seg.source is None or seg.source in catalogue, seg.source
    return out


def _vocab_param(spec, name, source, tp, rank) -> EngineParam:
    shard = vocab_shard(spec.vocab, tp, rank)
    segs = [Segment(source, shard.start, shard.real)]
    if shard.rows > shard.real:
        segs.append(Segment(None, 0, shard.rows - shard.real))
    return EngineParam(name, (shard.rows, spec.hidden), spec.dtype, 0, tuple(segs), "embeddings",
                       "target", None)


def _expert_params(spec: ModelSpec, topo: ReceiverTopology, rank: int, target: str) -> list:
    experts = spec.experts if target == "target" else spec.draft_experts
    return [EngineParam(engine_name(target, name), shape, spec.dtype, 0, (), "experts", target,
                        int(name.split(".")[2]))
            for name, shape in receiver_param_shapes(experts, topo, rank).items()]


@functools.lru_cache(maxsize=256)
def engine_params(spec: ModelSpec, topo: ReceiverTopology, rank: int) -> Mapping[str, EngineParam]:
    """Every parameter of engine rank ``rank`` (served model and draft), by engine name, in
    the model's order. A read-only mapping, computed once per (spec, topology, rank)."""
    validate_engine(spec, topo)
    _require(0 <= rank < topo.tp, "engine rank must be in range(tp)", rank=rank, tp=topo.tp)
    tp, H = topo.tp, spec.hidden
    out = [_vocab_param(spec, "model.embed_tokens.weight", "model.embed_tokens.weight", tp, rank)]
    for layer in range(spec.num_layers):
        out += _layer(spec, "target", layer, tp, rank)
    out += _expert_params(spec, topo, rank, "target")
    out.append(EngineParam("model.norm.weight", (H,), spec.dtype, 0,
                           _whole("model.norm.weight", (H,)), "norms", "target", None))
    head_source = "model.embed_tokens.weight" if spec.tied else "lm_head.weight"
    out.append(_vocab_param(spec, "lm_head.weight", head_source, tp, rank))
    if spec.mtp_layers:
        d = DRAFT_PREFIX
        out.append(EngineParam(d + "fc.weight", (H, 2 * H), spec.dtype, 0,
                               _whole("mtp.fc.weight", (H,)), "mtp", "draft", None))
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            out.append(EngineParam(f"{d}{norm}.weight", (H,), spec.dtype, 0,
                                   _whole(f"mtp.{norm}.weight", (H,)), "mtp", "draft", None))
        for layer in range(spec.mtp_layers):
            out += _layer(spec, "draft", layer, tp, rank)
        out += _expert_params(spec, topo, rank, "draft")
        out.append(EngineParam(d + "model.norm.weight", (H,), spec.dtype, 0,
                               _whole("mtp.norm.weight", (H,)), "mtp", "draft", None))
    return MappingProxyType({p.name: p for p in out})


class SourceUse(NamedTuple):
    """Where one checkpoint tensor's run lands: ``engine`` parameter indices ``[dst, dst +
    size)`` along ``axis`` take the source's ``[src, src + size)``."""

    engine: str
    axis: int
    dst: int
    src: int
    size: int


@functools.lru_cache(maxsize=256)
def source_uses(spec: ModelSpec, topo: ReceiverTopology, rank: int) -> Mapping[str, tuple]:
    """Checkpoint name -> every run of it (:class:`SourceUse`) that engine rank ``rank``
    holds; read only, computed once."""
    out: dict[str, list[SourceUse]] = {}
    for p in engine_params(spec, topo, rank).values():
        offset = 0
        for seg in p.segments:
            if seg.source is not None and seg.size:
                out.setdefault(seg.source, []).append(
                    SourceUse(p.name, p.axis, offset, seg.start, seg.size))
            offset += seg.size
    return MappingProxyType({name: tuple(uses) for name, uses in out.items()})


def padding_of(param: EngineParam) -> list[tuple[int, int]]:
    """``(start, size)`` along the axis of every zero-padding run of ``param``."""
    runs, offset = [], 0
    for seg in param.segments:
        if seg.source is None and seg.size:
            runs.append((offset, seg.size))
        offset += seg.size
    return runs


# --------------------------------------------------------------------------------------------
# Locating an element (for messages)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLocation:
    """Checkpoint coordinates of one engine element: ``source`` tensor, its layer, and the
    element's ``row``/``col`` in the checkpoint tensor (``col`` flattens trailing dims).
    Padding has no source."""

    param: str
    source: Optional[str]
    layer: Optional[int]
    row: Optional[int]
    col: Optional[int]
    rank: Optional[int] = None

    def __str__(self) -> str:
        if self.source is None:
            where = f"parameter={self.param} (zero padding)"
        else:
            where = f"parameter={self.source} row={self.row} col={self.col}"
            if self.source != self.param:
                where += f" (engine {self.param})"
        if self.layer is not None:
            where = f"layer={self.layer} " + where
        if self.rank is not None:
            where += f" receiver_rank={self.rank}"
        return where


def locate_engine_element(spec: ModelSpec, topo: ReceiverTopology, rank: int, name: str,
                          index: tuple, params: Optional[dict] = None) -> Optional[ModelLocation]:
    """Checkpoint coordinates of ``engine_param[index]`` (``None`` for expert parameters,
    which :func:`~pytest_weightsync.reference_impl.model.locate.locate_receiver_element` locates)."""
    params = engine_params(spec, topo, rank) if params is None else params
    p = params.get(name)
    if p is None or p.part == "experts":
        return None
    index = tuple(int(i) for i in index)
    along = index[p.axis] if index else 0
    offset = 0
    for seg in p.segments:
        if along < offset + seg.size:
            if seg.source is None:
                return ModelLocation(name, None, p.layer, None, None, rank)
            coord = list(index) or [0]
            coord[p.axis] = seg.start + along - offset
            row = coord[0]
            rest = coord[1:]
            shape = p.shape[1:]
            col = 0
            for i, size in zip(rest, shape):  # axis 1 params are 2-D: col is the source's
                col = col * size + i
            return ModelLocation(name, seg.source, p.layer, row, col, rank)
        offset += seg.size
    return None
