"""A Megatron -> Hugging Face name converter that knows only real Qwen3-MoE / Qwen3.5-MoE names.

RL trainers' refit code converts every parameter of the model it is handed and stops at the
first name it does not know: slime's ``convert_qwen3moe_to_hf`` / ``convert_qwen3_5_to_hf``
(``slime/backends/megatron_utils/megatron_to_hf/``, THUDM/slime @ 624b824a) raise
``ValueError("Unknown parameter name: ...")``, Megatron-Bridge finds no mapping. This is that
behaviour, written for the self-tests from the names those converters and Megatron-Bridge
0.3.1's ``Qwen3MoEBridge`` / ``Qwen3NextBridge`` registries map (megatron-core's Transformer
Engine spec, as real jobs build it):

* outside the layers: the word embedding, the final RMSNorm's weight, the output layer;
* each attention layer: the input norm fused into ``linear_qkv`` (``layer_norm_weight``),
  ``linear_qkv`` and ``linear_proj`` without biases, the q/k RMS norms; Qwen3.5's Gated
  DeltaNet layers megatron-core's ``in_proj`` (its fused input norm), ``conv1d``, ``A_log``,
  ``dt_bias``, ``out_norm``, ``out_proj``;
* the MoE block: ``pre_mlp_layernorm``, the router (and its ``expert_bias``, which both slime
  converters map), the routed experts (``TEGroupedMLP`` ``linear_fc{1,2}.weight{i}`` and
  ``SequentialMLP`` ``local_experts.{i}``), Qwen3.5's shared expert and its gate;
* Qwen3.5's MTP block: ``eh_proj``, ``enorm``, ``hnorm``, ``final_layernorm`` and one
  transformer layer named as a decoder layer.

Nothing else: no position embedding, no norm or linear bias, no local-spec
``input_layernorm`` (slime's converters do not know it either). Only names are converted
here; values are the exporter's business.
"""

from __future__ import annotations

import re

from pytest_weightsync.reference_impl.model import families

#: The builtin families and the layer kinds they have (a view of their records; a registered
#: family is converted from its own record).
FAMILIES = {name: families.get(name).layer_parts for name in families.names()}
UNKNOWN = "Unknown parameter name"

_TOP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}
_LAYER = {
    "attention": {
        "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
        "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
        "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
        "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
        "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
        "mlp.router.weight": ("mlp.gate.weight",),
        "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    },
    "gdn": {
        "self_attention.in_proj.layer_norm_weight": ("input_layernorm.weight",),
        "self_attention.in_proj.weight": ("linear_attn.in_proj_qkv.weight",
                                          "linear_attn.in_proj_z.weight",
                                          "linear_attn.in_proj_b.weight",
                                          "linear_attn.in_proj_a.weight"),
        "self_attention.conv1d.weight": ("linear_attn.conv1d.weight",),
        "self_attention.A_log": ("linear_attn.A_log",),
        "self_attention.dt_bias": ("linear_attn.dt_bias",),
        "self_attention.out_norm.weight": ("linear_attn.norm.weight",),
        "self_attention.out_proj.weight": ("linear_attn.out_proj.weight",),
    },
    "shared_expert": {
        "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                                 "mlp.shared_expert.up_proj.weight"),
        "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
        "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
    },
}
_MTP_HEAD = {
    "eh_proj.weight": ("mtp.fc.weight",),
    "enorm.weight": ("mtp.pre_fc_norm_embedding.weight",),
    "hnorm.weight": ("mtp.pre_fc_norm_hidden.weight",),
    "final_layernorm.weight": ("mtp.norm.weight",),
}
_DECODER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_TE_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")
_SEQ_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def _expert(prefix: str, rest: str):
    m = _TE_EXPERT.fullmatch(rest)
    fc, expert = (m.group(1), m.group(2)) if m else (None, None)
    m = _SEQ_EXPERT.fullmatch(rest)
    if m:
        expert, fc = m.group(1), m.group(2)
    if fc is None:
        return None
    e = f"{prefix}.mlp.experts.{expert}"
    return (f"{e}.gate_proj.weight", f"{e}.up_proj.weight") if fc == "1" \
        else (f"{e}.down_proj.weight",)


def _layer(family: str, prefix: str, rest: str):
    for kind in families.get(family).layer_parts:
        if rest in _LAYER[kind]:
            return tuple(f"{prefix}.{hf}" for hf in _LAYER[kind][rest])
    return _expert(prefix, rest)


def hf_names(family: str, name: str) -> tuple:
    """The checkpoint names Megatron parameter ``name`` (wrapper prefixes allowed, stage-local
    layer numbers) converts to; ``ValueError("Unknown parameter name: ...")`` for any name a
    real ``family`` model does not have."""
    if not families.is_registered(family):
        raise ValueError(f"unsupported model family {family!r}: expected one of "
                         f"{sorted(families.names())}")
    own = name
    while own.startswith("module."):
        own = own[len("module."):]
    out = _TOP.get(own)
    m = _DECODER.fullmatch(own)
    if out is None and m:
        out = _layer(family, f"model.layers.{m.group(1)}", m.group(2))
    m = _MTP.fullmatch(own)
    if out is None and m and families.get(family).has_draft:
        rest = m.group(2)
        out = _MTP_HEAD.get(rest)
        if out is None and rest.startswith("transformer_layer."):
            out = _layer(family, f"mtp.layers.{m.group(1)}", rest[len("transformer_layer."):])
    if out is None:
        raise ValueError(f"{UNKNOWN}: {name}")
    return out
