"""A whole MoE model, parameter by parameter, as its Hugging Face checkpoint names it.

The expert spec (:class:`~pytest_weightsync.reference_impl.model.layout.MoESpec`) covers the routed
experts only. A refit moves every parameter, so :class:`ModelSpec` describes the two model
families the suites run, with every tensor their checkpoints hold:

* ``qwen3_moe`` (Qwen3-MoE, SGLang ``Qwen3MoeForCausalLM``): every layer is GQA attention
  (``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``q_norm``/``k_norm``) with a sparse MoE
  block (router ``mlp.gate``, routed experts); no shared expert, no draft model.
* ``qwen3_5_moe`` (Qwen3.5-MoE, SGLang ``Qwen3_5MoeForConditionalGeneration``, language
  model): layer ``l`` is full attention when ``(l + 1) % full_attention_interval == 0``
  (with the attention output gate: ``q_proj`` holds ``[q_h; gate_h]`` per head), else a Gated
  DeltaNet layer (``linear_attn.in_proj_qkv = [q; k; v]``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``, ``conv1d [2qk + v, 1, K]``, ``A_log`` (float32), ``dt_bias``, ``norm``,
  ``out_proj``); every MoE block has a shared expert (``mlp.shared_expert.{gate,up,down}_proj``)
  and its gate (``mlp.shared_expert_gate [1, H]``); ``mtp_layers=1`` adds the multi-token
  prediction draft (``mtp.fc [H, 2H]``, ``mtp.pre_fc_norm_{embedding,hidden}``, one attention
  layer ``mtp.layers.0.*`` with its own MoE block, ``mtp.norm``), a second update target.

Variants both families take: tied embeddings (no ``lm_head.weight`` in the checkpoint), a
float32 router weight and a float32 ``mlp.gate.e_score_correction_bias`` (the noaux-tc expert
bias). Stock Qwen checkpoints have a bf16 router and no bias; the float32 variants are the
layout of GLM-4.5 MoE (``Glm4MoeGate``) and DeepSeek-V3 (``MoEGate`` with ``router_fp32``),
the parameters RL stacks have cut to bf16 (miles#811, prime-rl#3524) or left unmapped
(Megatron-Bridge#4199).

What a family changes (layer kinds, parts, the gated query, the fields it needs or lacks)
is its record in :mod:`.families`; this module reads it and has no branch per family.

Names here are checkpoint names without the ``model.language_model.`` prefix of the Qwen3.5
VL checkpoints (both SGLang Qwen3.5 loaders accept ``model.layers...``). Nothing here knows
how an engine or a trainer shards them: that is :mod:`~pytest_weightsync.reference_impl.model.model_layout`
(engine) and :mod:`~pytest_weightsync.reference_impl.trainer.megatron_model` (trainer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

import torch

from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model.layout import MoESpec
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.vocabulary import MODEL_PARTS, TARGETS

__all__ = [
    "HFParam", "MTP_PREFIX", "ModelSpec", "ModelWeights", "expert_spec_of", "hf_params",
    "layer_prefix", "qwen3_5_35b_a3b", "qwen3_5_moe", "qwen3_moe", "value_layer",
]

#: Checkpoint prefix of the draft (MTP) model's tensors.
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a whole MoE model of a registered family (:mod:`.families`; the builtin ones
    are :data:`~pytest_weightsync.vocabulary.MODEL_FAMILIES`).

    ``num_layers``, ``num_experts``, ``hidden``, ``intermediate`` (routed expert FFN size) and
    ``dtype`` have the meaning they have in :class:`MoESpec` (:attr:`experts` is that spec), so
    expert code reads either. ``intermediate_shared`` is the shared expert's FFN size
    (``qwen3_5_moe`` only). GDN sizes: ``linear_k_heads`` key heads and ``linear_v_heads``
    value heads of ``linear_k_dim`` / ``linear_v_dim`` channels, convolution width
    ``conv_kernel``."""

    family: str
    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_shared: int = 0
    full_attention_interval: int = 1
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    tied: bool = False
    router_dtype: torch.dtype = torch.bfloat16
    expert_bias: bool = False
    mtp_layers: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        _require(families.is_registered(self.family),
                 f"ModelSpec.family must be one of {families.names()}", family=self.family)
        record = self.family_record
        for name in ("num_layers", "num_experts", "hidden", "intermediate", "vocab", "num_heads",
                     "num_kv_heads", "head_dim", "full_attention_interval"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     f"ModelSpec.{name} must be an int >= 1", **{name: value})
        _require(self.num_heads % self.num_kv_heads == 0,
                 "num_heads must be a multiple of num_kv_heads (GQA)",
                 num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        _require(self.dtype == torch.bfloat16, "ModelSpec.dtype: only bfloat16 models are modelled",
                 dtype=self.dtype)
        _require(self.router_dtype in (torch.bfloat16, torch.float32),
                 "ModelSpec.router_dtype must be torch.bfloat16 or torch.float32",
                 router_dtype=self.router_dtype)
        _require(self.mtp_layers in (0, 1), "ModelSpec.mtp_layers must be 0 or 1",
                 mtp_layers=self.mtp_layers)
        for name in record.required_fields:
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1,
                     f"ModelSpec.{name} must be an int >= 1 for {self.family}", **{name: value})
        if record.gdn:
            _require(self.linear_v_heads % self.linear_k_heads == 0,
                     "linear_v_heads must be a multiple of linear_k_heads",
                     linear_v_heads=self.linear_v_heads, linear_k_heads=self.linear_k_heads)
        _require(all(getattr(self, name) == value for name, value in record.fixed_fields.items()),
                 record.fixed_message, **{name: getattr(self, name) for name in record.fixed_shown})

    @property
    def family_record(self) -> "families.ModelFamily":
        """The family's record: every fact the layouts read that is not a size."""
        return families.get(self.family)

    # -- derived sizes ---------------------------------------------------------------------

    @property
    def experts(self) -> MoESpec:
        """The routed experts of the served model, as the expert suites know them."""
        return MoESpec(self.num_layers, self.num_experts, self.hidden, self.intermediate,
                       self.dtype)

    @property
    def draft_experts(self) -> Optional[MoESpec]:
        """The routed experts of the draft model (its ``mtp_layers`` layers), or ``None``."""
        if not self.mtp_layers:
            return None
        return MoESpec(self.mtp_layers, self.num_experts, self.hidden, self.intermediate,
                       self.dtype)

    @property
    def attn_output_gate(self) -> bool:
        """Qwen3.5 full attention gates its output: ``q_proj`` carries a gate per head."""
        return self.family_record.attn_output_gate

    @property
    def q_rows(self) -> int:
        """Rows of ``q_proj``: ``[q_h; gate_h]`` per head with the output gate."""
        return self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gdn_qk(self) -> int:
        """Channels of the GDN query (and of the key) projection."""
        return self.linear_k_heads * self.linear_k_dim

    @property
    def gdn_v(self) -> int:
        """Channels of the GDN value (and of the ``z`` gate) projection."""
        return self.linear_v_heads * self.linear_v_dim

    def layer_kind(self, layer: int) -> str:
        """``"attention"`` or ``"gdn"`` for served layer ``layer`` (draft layers: attention)."""
        return self.family_record.layer_kind(self.full_attention_interval, layer)

    @property
    def targets(self) -> tuple[str, ...]:
        """The engine models an update of this model can reach (``TARGETS`` order)."""
        return ("target", "draft") if self.mtp_layers else ("target",)

    @property
    def parts(self) -> frozenset:
        """The parameter groups (:data:`~pytest_weightsync.vocabulary.MODEL_PARTS`) this model has."""
        parts = {"experts", "attention", "router", "norms", "embeddings"}
        parts |= self.family_record.extra_parts
        if self.router_dtype == torch.float32:
            parts.add("router_fp32")
        if self.expert_bias:
            parts.add("expert_bias")
        if self.tied:
            parts.add("tied_embeddings")
        assert parts <= set(MODEL_PARTS), parts - set(MODEL_PARTS)
        return frozenset(parts)

    @property
    def id(self) -> str:
        fam = self.family_record.id_prefix
        extra = "".join((
            "-tied" if self.tied else "",
            "-r32" if self.router_dtype == torch.float32 else "",
            "-bias" if self.expert_bias else "",
            f"-mtp{self.mtp_layers}" if self.mtp_layers else "",
        ))
        return (f"{fam}L{self.num_layers}E{self.num_experts}H{self.hidden}I{self.intermediate}"
                f"V{self.vocab}h{self.num_heads}kv{self.num_kv_heads}{extra}")


class HFParam(NamedTuple):
    """One checkpoint tensor (experts excluded: the expert formats name those)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    part: str               # one of MODEL_PARTS, or "mtp" (the draft's own head tensors)
    target: str             # "target" or "draft"
    layer: Optional[int]    # layer index inside its target (None: not per layer)


def layer_prefix(target: str, layer: int) -> str:
    """Checkpoint prefix of a layer: ``model.layers.{L}`` (served) or ``mtp.layers.{L}``."""
    return f"model.layers.{layer}" if target == "target" else f"mtp.layers.{layer}"


def _layer_params(spec: ModelSpec, target: str, layer: int, kind: str) -> list[HFParam]:
    p = layer_prefix(target, layer)
    H, bf = spec.hidden, spec.dtype
    out = []

    def add(name, shape, part, dtype=bf):
        out.append(HFParam(f"{p}.{name}", tuple(shape), dtype, part, target, layer))

    add("input_layernorm.weight", (H,), "norms")
    add("post_attention_layernorm.weight", (H,), "norms")
    if kind == "attention":
        add("self_attn.q_proj.weight", (spec.q_rows, H), "attention")
        add("self_attn.k_proj.weight", (spec.kv_rows, H), "attention")
        add("self_attn.v_proj.weight", (spec.kv_rows, H), "attention")
        add("self_attn.o_proj.weight", (H, spec.num_heads * spec.head_dim), "attention")
        add("self_attn.q_norm.weight", (spec.head_dim,), "attention")
        add("self_attn.k_norm.weight", (spec.head_dim,), "attention")
    else:
        qk, v, nv = spec.gdn_qk, spec.gdn_v, spec.linear_v_heads
        add("linear_attn.in_proj_qkv.weight", (2 * qk + v, H), "gdn")
        add("linear_attn.in_proj_z.weight", (v, H), "gdn")
        add("linear_attn.in_proj_b.weight", (nv, H), "gdn")
        add("linear_attn.in_proj_a.weight", (nv, H), "gdn")
        add("linear_attn.conv1d.weight", (2 * qk + v, 1, spec.conv_kernel), "gdn")
        add("linear_attn.A_log", (nv,), "gdn", torch.float32)
        add("linear_attn.dt_bias", (nv,), "gdn")
        add("linear_attn.norm.weight", (spec.linear_v_dim,), "gdn")
        add("linear_attn.out_proj.weight", (H, v), "gdn")
    add("mlp.gate.weight", (spec.num_experts, H), "router", spec.router_dtype)
    if spec.expert_bias:
        add("mlp.gate.e_score_correction_bias", (spec.num_experts,), "expert_bias",
            torch.float32)
    if spec.intermediate_shared:
        Is = spec.intermediate_shared
        add("mlp.shared_expert.gate_proj.weight", (Is, H), "shared_expert")
        add("mlp.shared_expert.up_proj.weight", (Is, H), "shared_expert")
        add("mlp.shared_expert.down_proj.weight", (H, Is), "shared_expert")
        add("mlp.shared_expert_gate.weight", (1, H), "shared_expert")
    return out


@functools.lru_cache(maxsize=64)
def hf_params(spec: ModelSpec) -> Mapping[str, HFParam]:
    """Every checkpoint tensor of ``spec`` except the routed experts, by name, in checkpoint
    order: embeddings, the served layers, the final norm, ``lm_head`` (untied only), then the
    draft's tensors. A read-only mapping, computed once per spec."""
    H, bf = spec.hidden, spec.dtype
    out = [HFParam("model.embed_tokens.weight", (spec.vocab, H), bf, "embeddings", "target", None)]
    for layer in range(spec.num_layers):
        out += _layer_params(spec, "target", layer, spec.layer_kind(layer))
    out.append(HFParam("model.norm.weight", (H,), bf, "norms", "target", None))
    if not spec.tied:
        out.append(HFParam("lm_head.weight", (spec.vocab, H), bf, "embeddings", "target", None))
    for layer in range(spec.mtp_layers):
        out.append(HFParam("mtp.fc.weight", (H, 2 * H), bf, "mtp", "draft", None))
        out.append(HFParam("mtp.pre_fc_norm_embedding.weight", (H,), bf, "mtp", "draft", None))
        out.append(HFParam("mtp.pre_fc_norm_hidden.weight", (H,), bf, "mtp", "draft", None))
        out += _layer_params(spec, "draft", layer, "attention")
        out.append(HFParam("mtp.norm.weight", (H,), bf, "mtp", "draft", None))
    return MappingProxyType({p.name: p for p in out})


def expert_spec_of(spec: ModelSpec, target: str) -> MoESpec:
    """The routed-expert spec of ``target`` (``"target"`` or ``"draft"``)."""
    _require(target in TARGETS, f"target must be one of {TARGETS}", target=target)
    experts = spec.experts if target == "target" else spec.draft_experts
    _require(experts is not None, "this model has no draft", target=target)
    return experts


def value_layer(spec: ModelSpec, target: str, layer: int) -> int:
    """The layer index the expert value function is keyed by: the served layers are
    ``0 .. num_layers - 1``, draft layer ``i`` is ``num_layers + i`` (so a draft expert never
    holds the values of a served one)."""
    return layer if target == "target" else spec.num_layers + layer


# --------------------------------------------------------------------------------------------
# The families' small configs and the GPU shapes
# --------------------------------------------------------------------------------------------


def qwen3_moe(**overrides) -> ModelSpec:
    """A small Qwen3-MoE: 2 layers, 4 experts, 4 query heads on 1 KV head (fewer KV heads than
    TP ranks from TP 2 on), a vocab of 37 (not divisible by any TP size)."""
    fields = dict(families.get("qwen3_moe").small_spec, family="qwen3_moe")
    fields.update(overrides)
    return ModelSpec(**fields)


def qwen3_5_moe(**overrides) -> ModelSpec:
    """A small Qwen3.5-MoE: 2 layers (a GDN layer, then full attention), 4 experts with a
    shared expert of the same FFN size (as Qwen3.5-35B-A3B), 2 key / 4 value GDN heads, 4
    query heads on 2 KV heads, a vocab of 37 and one MTP layer."""
    fields = dict(families.get("qwen3_5_moe").small_spec, family="qwen3_5_moe")
    fields.update(overrides)
    return ModelSpec(**fields)


def qwen3_5_35b_a3b(num_layers: int = 40, **overrides) -> ModelSpec:
    """Qwen3.5-35B-A3B's shapes for the GPU suites: hidden 2048, 256 experts of FFN 512 with a
    shared expert of 512, GDN with 16 key / 32 value heads of dim 128, full attention every 4th
    layer, one MTP layer (docs/layout.md); the attention (16 query heads on 2 KV heads of dim
    256) and vocabulary (248320) sizes follow the published config."""
    fields = dict(family="qwen3_5_moe", num_layers=num_layers, num_experts=256, hidden=2048,
                  intermediate=512, vocab=248320, num_heads=16, num_kv_heads=2, head_dim=256,
                  intermediate_shared=512, full_attention_interval=4, linear_k_heads=16,
                  linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, conv_kernel=4,
                  mtp_layers=1)
    fields.update(overrides)
    return ModelSpec(**fields)


@dataclass(frozen=True)
class ModelWeights:
    """A whole model's checkpoint at one version: ``dense`` maps every non-expert checkpoint
    name to its full tensor; ``experts[target]`` is that target's full expert weights
    (``{layer: (ExpertWeights of expert 0, ...)}``, layers numbered inside the target)."""

    dense: dict
    experts: dict
