"""Where every checkpoint row lands in a vLLM engine rank: vLLM 0.33.0's parameter layouts.

The second engine family. :mod:`~pytest_weightsync.reference_impl.model.layout` and
:mod:`~pytest_weightsync.reference_impl.model.model_layout` model SGLang 0.5.23; this module
models vLLM 0.33.0 for the same models (Qwen3-MoE, Qwen3.5-MoE and its MTP draft) and for
experts-only MoE layers. Where the two engines agree this module reuses their code (the
segments of every dense parameter, the vocabulary rows, :class:`ReceiverShard`); where they
differ it says so below, with the vLLM source (paths under ``vllm/`` of the 0.33.0 wheel).
Every fact here is checked against that source by ``suites/selftest/test_vllm_layouts.py``
(vLLM's own loading functions, compiled from the wheel's text and run on CPU, and its
constants, mappings and module tree read from the AST); ``docs/vllm.md`` is the prose.
What differs between the model families (classes, renames, prefixes, module tree) is the
family's record (:mod:`~pytest_weightsync.reference_impl.model.families`), read here.

Agreement with SGLang (reused, not restated):

* ``QKVParallelLinear`` (``layers/linear.py``): ``[q_r; k_r; v_r]``, KV heads replicated on
  ``tp / kv_heads`` consecutive ranks when there are fewer KV heads than ranks
  (``num_kv_head_replicas``; ``_ColumnvLLMParameter.load_qkv_weight`` takes KV shard
  ``tp_rank // num_kv_head_replicas``); Qwen3.5's gated query is ``2 * heads`` heads of
  ``[q_h; gate_h]`` rows (``qwen3_next.py`` ``Qwen3NextAttention``: ``total_num_heads * (1 +
  attn_output_gate)``);
* ``MergedColumnParallelLinear``: component by component (``[gate_r; up_r]``, GDN
  ``in_proj_qkvz = [q_r; k_r; v_r; z_r]`` from ``in_proj_qkv`` (shard ids ``(0, 1, 2)``) and
  ``in_proj_z`` (3), ``in_proj_ba = [b_r; a_r]``): ``qwen3_5.py`` ``Qwen3_5Model.hf_to_vllm_mapper``
  and ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` ``create_qkvz_proj`` / ``create_ba_proj``
  (``gqa_interleaved_layout=False``: four / two output sizes);
* GDN ``conv1d`` ``[q_r; k_r; v_r]`` (``mamba_v2_sharded_weight_loader``), ``A_log`` (float32)
  and ``dt_bias`` (``sharded_weight_loader(0)``); ``RowParallelLinear`` columns; replicated
  norms, router (``GateLinear``, a ``ReplicatedLinear``) and ``shared_expert_gate``;
* routed experts: ``w13_weight [E_local, 2 * I / moe_tp, H]`` with gate in the first half (shard
  id ``w1``) and up in the second (``w3``), ``w2_weight [E_local, H, I / moe_tp]``, rank ``r`` of
  MoE-TP taking rows ``[r * I / moe_tp, ...)`` (``layers/fused_moe/routed_experts.py``
  ``_load_w13`` / ``_load_w2``, ``unquantized_fused_moe_method.py`` ``create_weights``): SGLang's
  default layout (order ``gate_up``, even, unpadded) - :func:`receiver_topology` gives the SGLang
  topology with the same placement;
* the expert checkpoint formats it loads: per-expert ``experts.{e}.{gate,up,down}_proj.weight``
  (``compat``) and fused ``experts.gate_up_proj [E, 2I, H]`` (gate rows first: ``chunk(2,
  dim=1)``, chunk 0 is ``w1``) / ``experts.down_proj [E, H, I]`` (``hf_fused``)
  (``RoutedExperts.build_expert_params_mapping``, ``load_weights``).

Where vLLM differs (modelled here):

* **expert names**: ``model.layers.{L}.mlp.experts.routed_experts.{w13,w2}_weight`` - the MoE
  block's ``experts`` is a ``MoERunner`` (``FusedMoEFactory``, ``layers/fused_moe/layer.py``)
  holding the weights in ``routed_experts`` (``runner/moe_runner.py``);
* **MoE parallelism is all-TP or all-EP** (``config.py`` ``FusedMoEParallelConfig.make``): without
  ``enable_expert_parallel`` every rank of the ``tp * dp`` MoE group is an MoE-TP rank
  (``flatten_tp_across_dp_and_pcp``: MoE rank = ``dp_rank * tp + tp_rank``); with it, MoE-TP is
  1 and EP is ``tp * dp``. No MoE-TP x MoE-EP mix, no SGLang-style MoE-DP replicas;
* **uneven EP placement**: ``expert_map_manager.py`` ``determine_expert_map`` ("linear"): the
  first ``E % ep`` ranks hold one expert more (SGLang requires ``E % ep == 0``; the harness's
  engines express it as ``ReceiverTopology(expert_placement="linear_uneven")``, which
  :func:`receiver_topology` returns and :func:`vllm_topology` reads back). Round-robin
  placement is for grouped-expert models only (``determine_expert_placement_strategy`` falls
  back to linear), so never for these Qwen models;
* **no blocked padding**: ``FusedMoEConfig.__post_init__`` asserts ``I % moe_tp == 0``;
* **the vocabulary** pads to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``) and then must
  divide by TP (``divide``), where SGLang pads further to ``64 * tp``: vLLM refuses e.g. TP 3;
* **tied embeddings**: ``lm_head.tie_weights(embed_tokens)`` makes ``lm_head.weight`` the very
  ``Parameter`` of ``embed_tokens`` (``qwen3_moe.py`` and ``qwen3_5.py``; also for Qwen3-MoE,
  whose SGLang loader has no tied branch): one engine tensor, no ``lm_head.weight`` of its own;
* **Qwen3.5 attention** sits under ``self_attn.`` (``qwen3_5.py`` ``Qwen3_5DecoderLayer``), where
  SGLang holds ``qkv_proj`` directly on the layer;
* **the MTP draft** (``qwen3_5_mtp.py`` ``Qwen3_5MoeMTP``) names its tensors ``model.fc``,
  ``model.pre_fc_norm_{embedding,hidden}``, ``model.layers.0.*``, ``model.norm`` (checkpoint
  ``mtp.`` renamed ``model.``), and its ``fc`` is a ``ColumnParallelLinear``: TP-sharded rows
  ``[r * H / tp, ...)`` of ``[H, 2H]`` (SGLang's is a replicated ``nn.Linear``);
* **refusals** of the model classes: TP larger than the number of experts
  (``Qwen3MoeSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``), query heads not divisible by TP.

Not modelled: EPLB redundant experts (vLLM's initial map equals SGLang's trivial one,
``EplbState.build_initial_global_physical_to_logical_map``), round-robin placement,
``flashinfer_trtllm`` / AITER intermediate rounding and their post-load transforms, fused shared
experts (ROCm AITER), the VL wrapper ``Qwen3_5MoeForConditionalGeneration`` (its names carry a
``language_model.`` prefix), a float32 router or expert bias (vLLM's Qwen gates are model-dtype
``GateLinear`` without a bias), and data parallel attention for whole models (``dp`` > 1).
Like SGLang's model, every engine name of the draft carries :data:`DRAFT_PREFIX`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverShard,
    ReceiverTopology,
    TopologyError,
)
from pytest_weightsync.reference_impl.model.model_layout import (
    DRAFT_PREFIX,
    EngineParam,
    Segment,
    VocabShard,
    split_engine_name,
)
from pytest_weightsync.reference_impl.model.model_layout import engine_params as sglang_params
from pytest_weightsync.reference_impl.model.model_layout import vocab_shard as sglang_vocab_shard
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec

__all__ = [
    "DRAFT_CLASS", "FUSED_CHUNK_DIM", "FUSED_GATE_UP", "IGNORED_FORMATS", "LOADED_FORMATS",
    "MODEL_CLASSES", "MODULE_TREE", "PARAMETERS", "PER_EXPERT_FUSED_CHUNK_DIM", "PLACEMENTS",
    "ROOTS", "ROUTED_EXPERTS", "SERVED_PREFIXES", "SHARDED_DIM", "SHARD_IDS", "STACKED",
    "VLLM_TORCH_PIN", "VLLM_VERSION", "VOCAB_PADDING", "VllmTopology", "W13_HALVES",
    "checkpoint_route", "engine_params", "expert_mapping", "expert_param_shapes",
    "expert_range", "expert_shard", "receiver_topology", "vllm_name", "vllm_topology",
    "vocab_shard",
]

#: The vLLM release modelled here, and the torch it pins (why it does not run in this
#: project's environment: ``docs/backends.md``).
VLLM_VERSION = "0.33.0"
VLLM_TORCH_PIN = "2.14.0"

# --------------------------------------------------------------------------------------------
# Routed experts
# --------------------------------------------------------------------------------------------

#: The ``MoERunner`` attribute that holds the expert weights (``runner/moe_runner.py``).
ROUTED_EXPERTS = "routed_experts"
#: Shard id of each projection in vLLM's expert mapping (``build_expert_params_mapping``).
SHARD_IDS = {"gate": "w1", "up": "w3", "down": "w2"}
#: Which half of ``w13_weight`` each w13 shard id fills (``_load_w13``: ``w1`` at offset 0).
W13_HALVES = ("w1", "w3")
#: The dimension of one expert's checkpoint tensor that MoE-TP shards, per shard id
#: (``SHARD_ID_TO_SHARDED_DIM`` in ``RoutedExperts.weight_loader``).
SHARDED_DIM = {"w1": 0, "w2": 1, "w3": 0}
#: The fused gate/up checkpoint name for Qwen's ``gate_proj`` / ``up_proj`` and the dimension
#: its ``[E, 2I, H]`` tensor is split in two along (``chunk(2, dim=1)``: chunk 0 is gate).
FUSED_GATE_UP = "gate_up_proj"
FUSED_CHUNK_DIM = 1
#: A per-expert fused ``experts.{e}.gate_up_proj`` ``[2I, H]`` is split along dim 0.
PER_EXPERT_FUSED_CHUNK_DIM = 0
#: Expert formats of this project that vLLM's ``load_weights`` loads; ``packed`` / ``direct``
#: (``experts.w13_weight`` / ``w2_weight``) match no entry of the expert mapping and are
#: skipped without an error (``RoutedExperts.load_weights`` yields nothing for them).
LOADED_FORMATS = frozenset({"compat", "hf_fused"})
IGNORED_FORMATS = frozenset({"packed", "direct"})
#: Expert placements modelled (``ExpertPlacementStrategy``); see the module docstring.
PLACEMENTS = ("linear",)


@dataclass(frozen=True)
class VllmTopology:
    """One vLLM engine: ``tp`` (``tensor_parallel_size``), ``dp`` (``data_parallel_size``,
    experts only) and ``expert_parallel`` (``enable_expert_parallel``).

    The MoE layers shard over all ``tp * dp`` ranks (:attr:`world_size`); engine rank ``r``
    is ``dp_rank * tp + tp_rank``. Without expert parallelism every rank is an MoE-TP rank
    (``moe_tp = tp * dp``); with it every rank is an EP rank holding whole experts
    (``moe_ep = tp * dp``)."""

    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     f"VllmTopology.{name} must be an int >= 1", **{name: value})
        _require(isinstance(self.expert_parallel, bool),
                 "VllmTopology.expert_parallel must be a bool",
                 expert_parallel=self.expert_parallel)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def moe_tp(self) -> int:
        return 1 if self.expert_parallel else self.world_size

    @property
    def moe_ep(self) -> int:
        return self.world_size if self.expert_parallel else 1

    @property
    def id(self) -> str:
        return (f"vllm-tp{self.tp}" + (f"-dp{self.dp}" if self.dp > 1 else "")
                + ("-ep" if self.expert_parallel else ""))


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global experts EP rank ``ep_rank`` of ``ep`` holds, in local-slot order
    (``determine_expert_map``, linear placement: the first ``num_experts % ep`` ranks hold one
    more)."""
    base, extra = divmod(num_experts, ep)
    count = base + (1 if ep_rank < extra else 0)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + count)


def validate_experts(spec: MoESpec, topo: VllmTopology) -> None:
    """Raise :class:`TopologyError` for an expert layer vLLM cannot build."""
    _require(spec.intermediate % topo.moe_tp == 0,
             "intermediate must be divisible by vLLM's MoE-TP size (tp * dp without expert "
             "parallelism; FusedMoEConfig asserts it, there is no padded loader)",
             intermediate=spec.intermediate, moe_tp=topo.moe_tp)


def expert_shard(spec: MoESpec, topo: VllmTopology, rank: int) -> ReceiverShard:
    """What engine rank ``rank`` (in ``range(topo.world_size)``) holds of every MoE layer:
    global experts at local slots ``0..``, intermediate rows ``[row_start, row_start +
    rows)`` of gate, up and down, unpadded (``buffer_rows == rows``)."""
    validate_experts(spec, topo)
    _require(0 <= rank < topo.world_size, "engine rank must be in range(tp * dp)", rank=rank,
             world_size=topo.world_size)
    moe_tp_rank = 0 if topo.expert_parallel else rank
    moe_ep_rank = rank if topo.expert_parallel else 0
    rows = spec.intermediate // topo.moe_tp
    return ReceiverShard(rank=rank, moe_tp_rank=moe_tp_rank, moe_ep_rank=moe_ep_rank,
                         moe_dp_rank=0,
                         experts=expert_range(spec.num_experts, topo.moe_ep, moe_ep_rank),
                         row_start=moe_tp_rank * rows, rows=rows, buffer_rows=rows)


def receiver_topology(spec: MoESpec, topo: VllmTopology) -> ReceiverTopology:
    """The harness receiver topology whose expert placement is vLLM's (``receiver_shard`` of
    it equals :func:`expert_shard`): SGLang's default layout for every even placement, and for
    an uneven EP placement (``num_experts % (tp * dp) != 0``, which SGLang refuses) the
    harness's ``expert_placement="linear_uneven"`` engine."""
    validate_experts(spec, topo)
    if spec.num_experts % topo.moe_ep == 0:
        return ReceiverTopology(tp=topo.world_size, moe_ep=topo.moe_ep)
    return ReceiverTopology(tp=topo.world_size, moe_ep=topo.moe_ep,
                            expert_placement="linear_uneven")


def expert_name(layer: int, param: str) -> str:
    """vLLM's name of a routed-expert parameter (``param`` is ``"w13"`` or ``"w2"``) of
    ``layer`` in the served model (the draft's carry :data:`DRAFT_PREFIX`)."""
    return f"model.layers.{layer}.mlp.experts.{ROUTED_EXPERTS}.{param}_weight"


def expert_param_shapes(spec: MoESpec, topo: VllmTopology, rank: int) -> dict[str, tuple]:
    """Names and shapes of every routed-expert parameter of engine rank ``rank``."""
    shard = expert_shard(spec, topo, rank)
    local = len(shard.experts)
    shapes = {}
    for layer in range(spec.num_layers):
        shapes[expert_name(layer, "w13")] = (local, 2 * shard.rows, spec.hidden)
        shapes[expert_name(layer, "w2")] = (local, spec.hidden, shard.rows)
    return shapes


def expert_mapping(num_experts: int) -> list[tuple]:
    """``(param_name, weight_name, expert_id, shard_id)`` entries vLLM matches expert
    checkpoint names with, for Qwen's ``gate_proj`` / ``down_proj`` / ``up_proj`` and no
    redundant experts, names relative to the MoE block, in vLLM's order: the fused
    ``experts.gate_up_proj`` (``expert_id`` is the chunk index) and ``experts.down_proj``, the
    per-expert fused ``experts.{e}.gate_up_proj.``, then the per-expert projections."""
    w13, w2 = "experts.w13_", "experts.w2_"
    halves = list(enumerate(W13_HALVES))
    out = [(w13 + "weight", f"experts.{FUSED_GATE_UP}", chunk, sid) for chunk, sid in halves]
    out.append((w2 + "weight", "experts.down_proj", 0, SHARD_IDS["down"]))
    out += [(w13, f"experts.{e}.{FUSED_GATE_UP}.", e, sid)
            for e in range(num_experts) for _, sid in halves]
    out += [(w13 if projection != "down" else w2, f"experts.{e}.{projection}_proj.", e,
             SHARD_IDS[projection])
            for e in range(num_experts) for projection in ("gate", "down", "up")]
    return out


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (``layers/vocab_parallel_embedding.py``).
VOCAB_PADDING = 64


def _view(read) -> Mapping:
    """``{builtin family: read(its record)}``, read-only: the old per-family tables, kept for
    their readers (the source checks, docs), derived so a fact is stated once."""
    return MappingProxyType({name: read(families.get(name)) for name in families.names()})


# Views of the builtin families' records (:mod:`.families`), where each fact lives once; the
# layout below reads the spec's own record, so a registered family needs no entry here.
#: The vLLM classes modelled: (file under ``vllm/model_executor/models/``, class).
MODEL_CLASSES = _view(lambda f: f.vllm_model)
DRAFT_CLASS = families.get("qwen3_5_moe").vllm_draft
#: Checkpoint substring -> (engine substring, shard id): the ``orig_to_new_stacked`` of the
#: inner model's ``hf_to_vllm_mapper`` (``Qwen3MoeModel``; ``Qwen3_5Model`` = ``Qwen3NextModel``'s
#: ``| `` its GDN entries), applied in this order.
STACKED = _view(lambda f: f.vllm_stacked)
#: Checkpoint prefix renames of the served model's outer mapper (``None``: not loaded):
#: ``Qwen3_5ForCausalLMBase.hf_to_vllm_mapper`` drops the draft's ``mtp.`` tensors.
SERVED_PREFIXES = _view(lambda f: f.vllm_served_prefixes)
#: The module tree the engine names walk: class -> {attribute: class it holds}. ``layers``
#: holds a ``ModuleList`` (``make_layers`` / ``nn.ModuleList``) of the class named; the MoE
#: block's ``experts`` is what ``FusedMoEFactory`` returns (a ``MoERunner``). Leaves are
#: parameters (see :data:`PARAMETERS`).
MODULE_TREE = _view(lambda f: f.vllm_module_tree)
#: Parameters (leaves) per holding class; every other holder has one ``weight``.
PARAMETERS = MappingProxyType({
    "RoutedExperts": ("w13_weight", "w2_weight"),
    "QwenGatedDeltaNetAttention": ("A_log", "dt_bias"),
})
#: The served model's root class and the draft's, per family.
ROOTS = _view(lambda f: f.vllm_roots)

_ATTN_PARAMS = "(qkv_proj|o_proj|q_norm|k_norm)"
_DRAFT_HEAD = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def vocab_shard(vocab: int, tp: int, rank: int) -> VocabShard:
    """vLLM's ``VocabParallelEmbedding`` rows of rank ``rank``: the vocabulary padded to a
    multiple of 64, which must divide by ``tp``; where it does, SGLang's rule gives the same
    rows (reused)."""
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    _require(padded % tp == 0, "vLLM pads the vocabulary to a multiple of 64 and requires the "
             "padded size to divide by TP (VocabParallelEmbedding: divide(num_embeddings_padded, "
             "tp_size)); SGLang pads to 64 * tp instead", vocab=vocab, padded=padded, tp=tp)
    return sglang_vocab_shard(vocab, tp, rank)


def validate_engine(spec: ModelSpec, topo: VllmTopology) -> None:
    """Raise :class:`TopologyError` for a whole model this module does not lay out on a vLLM
    engine (vLLM's own refusals, and what is not modelled)."""
    _require(topo.dp == 1, "whole-model vLLM engines are modelled at dp 1 (data parallel "
             "attention is not modelled)", dp=topo.dp)
    _require(spec.router_dtype == spec.dtype and not spec.expert_bias,
             "vLLM's Qwen MoE gates are model-dtype GateLinear layers without a bias: a float32 "
             "router or an expert bias is not modelled for vLLM", router_dtype=spec.router_dtype,
             expert_bias=spec.expert_bias)
    _require(topo.tp <= spec.num_experts, "vLLM's Qwen MoE blocks refuse a TP size greater than "
             "the number of experts", tp=topo.tp, num_experts=spec.num_experts)
    _require(spec.num_heads % topo.tp == 0, "query heads must divide by TP (vLLM's attention "
             "asserts total_num_heads % tp_size == 0)", num_heads=spec.num_heads, tp=topo.tp)
    if spec.mtp_layers:
        _require(spec.hidden % topo.tp == 0, "the draft's fc is a ColumnParallelLinear: hidden "
                 "must divide by TP", hidden=spec.hidden, tp=topo.tp)
    vocab_shard(spec.vocab, topo.tp, 0)
    validate_experts(spec.experts, topo)


def engine_name(spec: ModelSpec, target: str, own: str) -> str:
    """vLLM's engine name of a parameter SGLang's layout calls ``own`` in ``target``."""
    record = spec.family_record
    if record.sglang_attention_prefix != record.vllm_attention_prefix:
        own = re.sub(rf"(model\.layers\.[0-9]+\.){re.escape(record.sglang_attention_prefix)}"
                     rf"{_ATTN_PARAMS}\.weight",
                     rf"\g<1>{record.vllm_attention_prefix}\2.weight", own)
    if target == "draft" and own in _DRAFT_HEAD:
        own = "model." + own
    return own if target == "target" else DRAFT_PREFIX + own


def _vocab_param(spec: ModelSpec, p: EngineParam, tp: int, rank: int) -> EngineParam:
    shard = vocab_shard(spec.vocab, tp, rank)
    segs = [Segment(p.segments[0].source, shard.start, shard.real)]
    if shard.rows > shard.real:
        segs.append(Segment(None, 0, shard.rows - shard.real))
    return p._replace(shape=(shard.rows, spec.hidden), segments=tuple(segs))


def _expert_params(spec: ModelSpec, topo: VllmTopology, rank: int, target: str) -> list:
    experts = spec.experts if target == "target" else spec.draft_experts
    prefix = "" if target == "target" else DRAFT_PREFIX
    return [EngineParam(prefix + name, shape, spec.dtype, 0, (), "experts", target,
                        int(name.split(".")[2]))
            for name, shape in expert_param_shapes(experts, topo, rank).items()]


@functools.lru_cache(maxsize=256)
def engine_params(spec: ModelSpec, topo: VllmTopology, rank: int) -> Mapping[str, EngineParam]:
    """Every parameter of vLLM engine rank ``rank`` (served model and draft), by vLLM engine
    name, as :class:`~pytest_weightsync.reference_impl.model.model_layout.EngineParam` s (the
    segments say which checkpoint rows each holds). A read-only mapping, computed once."""
    validate_engine(spec, topo)
    _require(0 <= rank < topo.tp, "engine rank must be in range(tp)", rank=rank, tp=topo.tp)
    tp, out, experts_done = topo.tp, [], set()
    for p in sglang_params(spec, ReceiverTopology(tp=tp), rank).values():
        target, own = split_engine_name(p.name)
        if p.part == "experts":
            if target not in experts_done:
                out += _expert_params(spec, topo, rank, target)
                experts_done.add(target)
            continue
        if own == "lm_head.weight" and spec.tied:
            continue  # the same Parameter as model.embed_tokens.weight
        if p.part == "embeddings":
            p = _vocab_param(spec, p, tp, rank)
        if target == "draft" and own == "fc.weight":
            rows = spec.hidden // tp
            p = p._replace(shape=(rows, 2 * spec.hidden),
                           segments=(Segment("mtp.fc.weight", rank * rows, rows),))
        out.append(p._replace(name=engine_name(spec, target, own)))
    return MappingProxyType({p.name: p for p in out})


def checkpoint_route(spec: ModelSpec, name: str):
    """Where the served model's loader sends checkpoint tensor ``name``: ``(engine name of
    the receiving module path + parameter, shard id or None)``, or ``None`` when the served
    model drops it (the draft's ``mtp.`` tensors). Expert names are returned as they are
    (the MoE runner matches them with :func:`expert_mapping`)."""
    for prefix, new in spec.family_record.vllm_served_prefixes.items():
        if name.startswith(prefix):
            if new is None:
                return None
            name = new + name[len(prefix):]
    shard = None
    for old, (new, sid) in spec.family_record.vllm_stacked.items():
        if old in name:
            name, shard = name.replace(old, new, 1), sid
    return name, shard


# --------------------------------------------------------------------------------------------
# The harness's (SGLang) engines that are vLLM engines, and their names
# --------------------------------------------------------------------------------------------


def vllm_topology(receiver: ReceiverTopology):
    """The vLLM engine (:class:`VllmTopology`, ``dp`` 1) whose layout is the harness receiver
    ``receiver``'s, or ``None`` when vLLM has no such engine: an MoE-TP x MoE-EP mix, MoE-DP
    replicas, padded buffers, the up/gate order, or a non-checkpoint engine layout. A receiver
    with ``expert_placement="linear_uneven"`` (E % EP != 0 allowed) is vLLM's expert-parallel
    engine over all its ranks. (A whole model may still be refused on it:
    :func:`validate_engine`.)"""
    if (receiver.moe_dp != 1 or receiver.moe_ep not in (1, receiver.tp) or receiver.padded
            or receiver.order != "gate_up" or not receiver.default_engine):
        return None
    return VllmTopology(tp=receiver.tp, expert_parallel=receiver.moe_ep > 1 and receiver.tp > 1)


def vllm_name(spec: ModelSpec, name: str):
    """The vLLM engine name of the harness's (SGLang-layout) engine parameter ``name``, or
    ``None`` for the one vLLM does not hold apart (a tied ``lm_head.weight``). Same shape and
    rows wherever both engines build the model, but the draft's ``fc`` (vLLM shards it)."""
    target, own = split_engine_name(name)
    if own == "lm_head.weight" and spec.tied:
        return None
    m = re.fullmatch(r"model\.layers\.([0-9]+)\.mlp\.experts\.(w13|w2)_weight", own)
    if m:
        renamed = expert_name(int(m.group(1)), m.group(2))
        return renamed if target == "target" else DRAFT_PREFIX + renamed
    return engine_name(spec, target, own)
