"""The packed path: one ``w13_weight`` / ``w2_weight`` per layer holding every expert.

Tensors are in the receiver's native fused layout and gate/up order but unsharded
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``): every receiver rank gets the same payload and narrows
its experts and MoE-TP rows out of it. Skips the per-expert loader loop of the compatible path.

It needs an ENGINE-SIDE LOADER: stock SGLang (0.5.23) has no code path for these names (they
reach ``FusedMoE.weight_loader`` without shard or expert ids and raise). The reference receiver
accepts them as a model of such a loader; the format stock SGLang loads with every expert in
one tensor is ``hf_fused`` (:mod:`pytest_weightsync.reference_impl.hf_fused`).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl import fastcopy
from pytest_weightsync.reference_impl.layout import (
    ExpertWeights,
    MoESpec,
    WeightSyncError,
    fused_name,
    gate_up_halves,
    packed_shape,
)


def export_layer(spec: MoESpec, layer: int, experts: Sequence[ExpertWeights], order: str,
                 device=None) -> list[tuple[str, torch.Tensor]]:
    """``[(w13 name, [E, 2I, H]), (w2 name, [E, H, I])]`` of one layer in ``order``."""
    if len(experts) != spec.num_experts:
        raise WeightSyncError(f"packed export of layer {layer} needs all {spec.num_experts} "
                              f"experts, got {len(experts)}")
    device = experts[0].gate.device if device is None else device
    w13 = torch.empty(packed_shape(spec, "w13"), dtype=spec.dtype, device=device)
    w2 = torch.empty(packed_shape(spec, "w2"), dtype=spec.dtype, device=device)
    first, second = gate_up_halves(order)
    size = spec.intermediate
    pairs = []
    for e, weights in enumerate(experts):
        pairs.append((w13[e, :size], weights[first]))
        pairs.append((w13[e, size:], weights[second]))
        pairs.append((w2[e], weights.down))
    fastcopy.copy_pairs(pairs)
    return [(fused_name(layer, "w13"), w13), (fused_name(layer, "w2"), w2)]


def export(spec: MoESpec, full: Mapping[int, Sequence[ExpertWeights]], order: str,
           layers: Iterable[int] | None = None, device=None) -> list[tuple[str, torch.Tensor]]:
    """Packed payload of ``layers`` (default all), layer by layer."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(spec, layer, full[layer], order, device))
    return out
