"""The hf_fused path: SGLang's fused-expert checkpoint format, one tensor pair per layer.

``model.layers.{L}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` holds every expert's gate rows
then its up rows (gate first ALWAYS, whatever the receiver's runner order: SGLang splits it
with ``chunk(2, dim=-2)`` and routes each half by shard id), ``...experts.down_proj``
``[E, H, I]`` every expert's down projection. Unlike ``packed`` this is a format stock SGLang
loads through the model's own ``load_weights`` (``is_fused_expert`` /
``load_fused_expert_weights`` of the Qwen3-MoE and Qwen3.5-MoE models), and it is rank
independent: every receiver rank gets the same tensors and narrows its experts and MoE-TP rows.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.senders import zerocopy
from pytest_weightsync.reference_impl.model.layout import ExpertWeights, WeightSyncError, hf_fused_name
from pytest_weightsync.reference_impl.senders.zerocopy import staging_tensor


def layer_payload(layer: int, experts: Sequence[ExpertWeights], device=None,
                  alloc=None) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """``[(gate_up_proj name, [E, 2I, H]), (down_proj name, [E, H, I])]`` of one layer and the
    ``(dst, src)`` pairs still to be copied into it: views of the trainer's memory where it
    already has this layout (:func:`zerocopy.tiled_view`), else staging tensors from
    ``alloc(shape, dtype, device, zero)`` that the pairs fill. ``experts`` holds every expert
    of the layer, indexed by global id."""
    if not experts:
        raise WeightSyncError(f"hf_fused export of layer {layer} needs every expert, got none")
    gate = experts[0].gate
    device = gate.device if device is None else device
    alloc = alloc or staging_tensor
    size, hidden = gate.shape
    gate_up_shape, down_shape = (len(experts), 2 * size, hidden), (len(experts), hidden, size)
    gate_up = zerocopy.tiled_view([w[p] for w in experts for p in ("gate", "up")],
                                  gate_up_shape, gate.dtype, device)
    down = zerocopy.tiled_view([w.down for w in experts], down_shape, gate.dtype, device)
    stage_gate_up, stage_down = gate_up is None, down is None
    if stage_gate_up:
        gate_up = alloc(gate_up_shape, gate.dtype, device, False)
    if stage_down:
        down = alloc(down_shape, gate.dtype, device, False)
    pairs = []
    for e, weights in enumerate(experts):
        if stage_gate_up:
            pairs.append((gate_up[e, :size], weights.gate))
            pairs.append((gate_up[e, size:], weights.up))
        if stage_down:
            pairs.append((down[e], weights.down))
    return [(hf_fused_name(layer, "gate_up"), gate_up), (hf_fused_name(layer, "down"), down)], pairs


def export_layer(layer: int, experts: Sequence[ExpertWeights],
                 device=None) -> list[tuple[str, torch.Tensor]]:
    """``[(gate_up_proj name, [E, 2I, H]), (down_proj name, [E, H, I])]`` of one layer; views
    of the trainer's memory where it already has this layout, else filled staging tensors."""
    entries, pairs = layer_payload(layer, experts, device)
    fastcopy.copy_pairs(pairs)
    return entries


def export(full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None) -> list[tuple[str, torch.Tensor]]:
    """hf_fused payload of ``layers`` (default all), layer by layer."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(layer, full[layer], device))
    return out
