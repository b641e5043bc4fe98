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

from pytest_weightsync.reference_impl import fastcopy
from pytest_weightsync.reference_impl.layout import ExpertWeights, WeightSyncError, hf_fused_name


def export_layer(layer: int, experts: Sequence[ExpertWeights],
                 device=None) -> list[tuple[str, torch.Tensor]]:
    """``[(gate_up_proj name, [E, 2I, H]), (down_proj name, [E, H, I])]`` of one layer;
    ``experts`` holds every expert of the layer, indexed by global id."""
    if not experts:
        raise WeightSyncError(f"hf_fused export of layer {layer} needs every expert, got none")
    gate = experts[0].gate
    device = gate.device if device is None else device
    size, hidden = gate.shape
    gate_up = torch.empty((len(experts), 2 * size, hidden), dtype=gate.dtype, device=device)
    down = torch.empty((len(experts), hidden, size), dtype=gate.dtype, device=device)
    pairs = []
    for e, weights in enumerate(experts):
        pairs.append((gate_up[e, :size], weights.gate))
        pairs.append((gate_up[e, size:], weights.up))
        pairs.append((down[e], weights.down))
    fastcopy.copy_pairs(pairs)
    return [(hf_fused_name(layer, "gate_up"), gate_up), (hf_fused_name(layer, "down"), down)]


def export(full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None) -> list[tuple[str, torch.Tensor]]:
    """hf_fused payload of ``layers`` (default all), layer by layer."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(layer, full[layer], device))
    return out
