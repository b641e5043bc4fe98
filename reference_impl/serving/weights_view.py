"""An engine's own parameters read back as the checkpoint tensors they hold.

The serving engine computes with what its parameters hold after every update - never with the
values it was sent. Its parameters are SGLang's engine layout (fused ``qkv_proj``, fused
``w13`` experts in the receiver's gate/up order, vocabulary padding); the per-token forward
(:mod:`pytest_weightsync.reference_impl.oracle.token_forward`) reads checkpoint names. The
engine layout's segments (:func:`~pytest_weightsync.reference_impl.model.model_layout.engine_params`)
say where each checkpoint tensor lies, so this is that layout read backwards - for one engine
rank holding every shard (TP 1: a serving engine of the test matrix is one process).
"""

from __future__ import annotations

import torch

from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, gate_up_halves
from pytest_weightsync.reference_impl.model.model_layout import engine_params
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec
from pytest_weightsync.reference_impl.oracle.token_forward import (
    LayerWeights,
    ModelWeightsView,
    check_modelled,
    squash,
)

__all__ = ["checkpoint_tensors", "engine_weights"]


def checkpoint_tensors(spec: ModelSpec, topo: ReceiverTopology, params) -> dict:
    """Checkpoint name -> the tensor the engine parameters ``params`` hold for it (dense
    tensors only; views into ``params``)."""
    pieces: dict = {}
    for name, param in engine_params(spec, topo, 0).items():
        offset = 0
        for seg in param.segments:
            if seg.source is not None and seg.size:
                pieces.setdefault(seg.source, []).append(
                    (seg.start, params[name].narrow(param.axis, offset, seg.size), param.axis))
            offset += seg.size
    out = {}
    for source, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        out[source] = parts[0][1] if len(parts) == 1 else \
            torch.cat([p for _, p, _ in parts], dim=parts[0][2])
    return out


def engine_weights(spec: ModelSpec, topo: ReceiverTopology, params) -> ModelWeightsView:
    """What the per-token forward computes with, read from the engine's ``params`` now."""
    check_modelled(spec)
    if topo.tp != 1:
        raise ValueError(f"a serving engine model holds every shard (tp=1), got tp={topo.tp}")
    dense = checkpoint_tensors(spec, topo, params)
    first, _ = gate_up_halves(topo.order)
    layers = []
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        w13 = params[f"{p}mlp.experts.w13_weight"]
        half = w13.shape[1] // 2
        gate, up = (w13[:, :half], w13[:, half:]) if first == "gate" else \
            (w13[:, half:], w13[:, :half])
        layers.append(LayerWeights(
            q=squash(dense[p + "self_attn.q_proj.weight"]),
            k=squash(dense[p + "self_attn.k_proj.weight"]),
            v=squash(dense[p + "self_attn.v_proj.weight"]),
            o=squash(dense[p + "self_attn.o_proj.weight"]),
            q_norm=squash(dense[p + "self_attn.q_norm.weight"]),
            k_norm=squash(dense[p + "self_attn.k_norm.weight"]),
            in_norm=squash(dense[p + "input_layernorm.weight"]),
            post_norm=squash(dense[p + "post_attention_layernorm.weight"]),
            router=squash(dense[p + "mlp.gate.weight"]),
            gate=squash(gate), up=squash(up), down=squash(params[f"{p}mlp.experts.w2_weight"])))
    embed = dense["model.embed_tokens.weight"]
    head = embed if spec.tied else dense["lm_head.weight"]
    return ModelWeightsView(spec, squash(embed), layers, squash(dense["model.norm.weight"]),
                            squash(head))
