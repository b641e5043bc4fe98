"""How each tensor of a Megatron-Core Qwen3-MoE / Qwen3.5-MoE ``GPTModel`` becomes checkpoint
tensors: the name map and the TP conversions an RL team's Megatron -> HF converter carries.

Every non-expert Megatron tensor is one of these kinds, by how its TP ranks shard it:

* ``replicated``: norms, the router (its weight may be float32) and its float32 ``expert_bias``,
  the shared expert's gate - every rank holds the whole tensor, nothing is gathered;
* ``column``: rank ``t`` holds a contiguous run of rows (``A_log``, ``dt_bias``, the MTP
  ``eh_proj``);
* ``row``: rank ``t`` holds a run of columns (``linear_proj``, GDN ``out_proj``, the shared
  expert's ``linear_fc2``);
* ``components``: the tensor stacks components, each sharded on its own, so rank ``t`` holds
  ``[c0_t; c1_t; ...]`` (GDN ``in_proj = [q; k; v; z; b; a]`` and ``conv1d = [q; k; v]``, the
  shared expert's ``linear_fc1 = [gate; up]``): the shards are split into their components and
  joined component by component - concatenating whole shards gives the right shape and the
  wrong rows;
* ``qkv``: ``linear_qkv`` holds whole query groups per rank, each ``[q_g; k_g; v_g]`` (with
  Qwen3.5's attention output gate ``[q_g; gate_g; k_g; v_g]``), so the shards concatenate and
  are then split per group; the checkpoint's gated ``q_proj`` holds ``[q_h; gate_h]`` per head;
* ``vocab``: the embedding and output layer hold the vocabulary padded for the trainer's TP
  size; the shards concatenate and the padding rows (training garbage) are dropped.

Decoder layer ``l`` of a stage is named ``model.layers.{l + offset}`` (the stage's first global
layer); the MTP block's layer ``i`` is ``mtp.layers.{i}``. Routed experts (``.mlp.experts.``)
are not here: :mod:`.exporter` gathers them. Nothing here talks to other ranks.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

#: A transformer layer's Megatron tensors (local spec names, and the Transformer Engine spec's
#: fused input norms) -> (kind, checkpoint suffixes: one name, or (name, components) pairs).
_LAYER = {
    "input_layernorm.weight": ("replicated", "input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", "input_layernorm.weight"),
    "self_attention.in_proj.layer_norm_weight": ("replicated", "input_layernorm.weight"),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight",
                                                 "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_proj.weight": ("row", "self_attn.o_proj.weight"),
    "self_attention.q_layernorm.weight": ("replicated", "self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": ("replicated", "self_attn.k_norm.weight"),
    "self_attention.in_proj.weight": ("components", (("linear_attn.in_proj_qkv.weight", 3),
                                                     ("linear_attn.in_proj_z.weight", 1),
                                                     ("linear_attn.in_proj_b.weight", 1),
                                                     ("linear_attn.in_proj_a.weight", 1))),
    "self_attention.conv1d.weight": ("components", (("linear_attn.conv1d.weight", 3),)),
    "self_attention.A_log": ("column", "linear_attn.A_log"),
    "self_attention.dt_bias": ("column", "linear_attn.dt_bias"),
    "self_attention.out_norm.weight": ("replicated", "linear_attn.norm.weight"),
    "self_attention.out_proj.weight": ("row", "linear_attn.out_proj.weight"),
    "pre_mlp_layernorm.weight": ("replicated", "post_attention_layernorm.weight"),
    "mlp.router.weight": ("replicated", "mlp.gate.weight"),
    "mlp.router.expert_bias": ("replicated", "mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": ("components",
                                             (("mlp.shared_expert.gate_proj.weight", 1),
                                              ("mlp.shared_expert.up_proj.weight", 1))),
    "mlp.shared_experts.linear_fc2.weight": ("row", "mlp.shared_expert.down_proj.weight"),
    "mlp.shared_experts.gate_weight": ("replicated", "mlp.shared_expert_gate.weight"),
}
#: Tensors outside the layers.
_TOP = {
    "embedding.word_embeddings.weight": ("vocab", "model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": ("replicated", "model.norm.weight"),
    "output_layer.weight": ("vocab", "lm_head.weight"),
}
#: The MTP block's own tensors around its transformer layer.
_MTP_HEAD = {
    "eh_proj.weight": ("column", "mtp.fc.weight"),
    "enorm.weight": ("replicated", "mtp.pre_fc_norm_embedding.weight"),
    "hnorm.weight": ("replicated", "mtp.pre_fc_norm_hidden.weight"),
    "final_layernorm.weight": ("replicated", "mtp.norm.weight"),
}
_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"


class Conversion(NamedTuple):
    """How one Megatron tensor is unsharded (``kind``) and which checkpoint tensors it holds:
    ``outputs`` is ``((checkpoint name, components), ...)``; ``sizes`` the unsharded rows of
    each component (``components`` kind only)."""

    kind: str
    outputs: tuple
    sizes: tuple = ()


def _component_sizes(spec, suffix: str) -> tuple:
    qk, v = spec.linear_k_heads * spec.linear_k_dim, spec.linear_v_heads * spec.linear_v_dim
    if suffix == "self_attention.in_proj.weight":
        return (qk, qk, v, v, spec.linear_v_heads, spec.linear_v_heads)
    if suffix == "self_attention.conv1d.weight":
        return (qk, qk, v)
    return (spec.intermediate_shared,) * 2


def conversion(spec, name: str, offset: int) -> Conversion:
    """The :class:`Conversion` of Megatron tensor ``name`` (wrapper prefix removed, stage-local
    layer numbers) of a stage whose first layer is global layer ``offset``. Raises
    ``ValueError`` for a name the map does not know: a tensor is never dropped silently."""
    prefix, suffix, table = "", name, _TOP
    m = _DECODER.match(name)
    if m:
        prefix, suffix, table = f"model.layers.{int(m.group(1)) + offset}.", m.group(2), _LAYER
    else:
        m = _MTP.match(name)
        if m and m.group(2).startswith("transformer_layer."):
            prefix, table = f"mtp.layers.{m.group(1)}.", _LAYER
            suffix = m.group(2)[len("transformer_layer."):]
        elif m:
            suffix, table = m.group(2), _MTP_HEAD
    if suffix not in table:
        raise ValueError(f"{name}: no checkpoint name for this Megatron tensor")
    kind, hf = table[suffix]
    if kind == "components":
        return Conversion(kind, tuple((prefix + n, c) for n, c in hf),
                          _component_sizes(spec, suffix))
    names = hf if isinstance(hf, tuple) else (hf,)
    return Conversion(kind, tuple((prefix + n, 1) for n in names))


def _split_qkv(spec, qkv: torch.Tensor) -> tuple:
    """``(q_proj, k_proj, v_proj)`` from the unsharded ``linear_qkv`` (groups of ``[q_g;
    (gate_g;) k_g; v_g]``)."""
    d, groups = spec.head_dim, spec.num_kv_heads
    per = spec.num_heads // groups
    gated = spec.family == "qwen3_5_moe"  # the attention output gate
    rest = tuple(qkv.shape[1:])
    sizes = [per * d] * (2 if gated else 1) + [d, d]
    pieces = torch.split(qkv.reshape(groups, sum(sizes), *rest), sizes, dim=1)
    k, v = (p.reshape(groups * d, *rest) for p in pieces[-2:])
    if not gated:
        return pieces[0].reshape(-1, *rest), k, v
    q, gate = (p.reshape(spec.num_heads, d, *rest) for p in pieces[:2])
    return torch.stack([q, gate], dim=1).reshape(-1, *rest), k, v


def checkpoint_tensors(spec, conv: Conversion, shards) -> dict:
    """``{checkpoint name: tensor}`` from the tensor's TP shards in TP-rank order (one shard
    for ``replicated``), each in the shards' own dtype."""
    shards = list(shards)
    if conv.kind == "replicated":
        return {conv.outputs[0][0]: shards[0]}
    if conv.kind == "row":
        return {conv.outputs[0][0]: torch.cat(shards, dim=1)}
    if conv.kind == "components":
        tp = len(shards)
        split = [torch.split(s, [n // tp for n in conv.sizes], dim=0) for s in shards]
        components = [torch.cat([split[r][c] for r in range(tp)], dim=0)
                      for c in range(len(conv.sizes))]
        out, at = {}, 0
        for name, count in conv.outputs:
            parts = components[at:at + count]
            out[name] = parts[0] if count == 1 else torch.cat(parts, dim=0)
            at += count
        return out
    full = torch.cat(shards, dim=0)
    if conv.kind == "vocab":
        return {conv.outputs[0][0]: full[:spec.vocab]}
    if conv.kind == "qkv":
        return {name: t for (name, _), t in zip(conv.outputs, _split_qkv(spec, full))}
    return {conv.outputs[0][0]: full}  # column
