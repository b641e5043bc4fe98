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


def layer_payload(layer: int, experts: Sequence[ExpertWeights], device=None,
                  alloc=None) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """``[(gate_up_proj name, [E, 2I, H]), (down_proj name, [E, H, I])]`` of one layer and the
    ``(dst, src)`` pairs still to be copied into it: views of the trainer's memory where it
    already has this layout (:func:`zerocopy.expert_grids`), else staging tensors from
    ``alloc(shape, dtype, device, zero)`` that the pairs fill. ``experts`` holds every expert
    of the layer, indexed by global id."""
    if not experts:
        raise WeightSyncError(f"hf_fused export of layer {layer} needs every expert, got none")
    gate = experts[0].gate
    device = gate.device if device is None else device
    gate_up, down, pairs = zerocopy.stacked_experts(experts, ("gate", "up"), *gate.shape,
                                                    gate.dtype, device, alloc)
    return [(hf_fused_name(layer, "gate_up"), gate_up), (hf_fused_name(layer, "down"), down)], pairs


def export_layer(layer: int, experts: Sequence[ExpertWeights],
                 device=None, alloc=None) -> list[tuple[str, torch.Tensor]]:
    """``[(gate_up_proj name, [E, 2I, H]), (down_proj name, [E, H, I])]`` of one layer; views
    of the trainer's memory where it already has this layout, else filled staging tensors."""
    entries, pairs = layer_payload(layer, experts, device, alloc)
    fastcopy.copy_pairs(pairs)
    return entries


def export(full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None, alloc=None) -> list[tuple[str, torch.Tensor]]:
    """hf_fused payload of ``layers`` (default all), layer by layer."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(layer, full[layer], device, **zerocopy.staging_kwargs(alloc)))
    return out
