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
    ModelWeightsView,
    check_modelled,
    weights_from_checkpoint,
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
    first, _ = gate_up_halves(topo.order)
    experts = {}
    for layer in range(spec.num_layers):
        w13 = params[f"model.layers.{layer}.mlp.experts.w13_weight"]
        half = w13.shape[1] // 2
        low, high = w13[:, :half], w13[:, half:]
        gate, up = (low, high) if first == "gate" else (high, low)
        experts[layer] = (gate, up, params[f"model.layers.{layer}.mlp.experts.w2_weight"])
    return weights_from_checkpoint(spec, checkpoint_tensors(spec, topo, params), experts)
