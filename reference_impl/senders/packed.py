"""The packed path: one ``w13_weight`` / ``w2_weight`` per layer holding every expert.

Tensors are in the receiver's native fused layout and gate/up order but unsharded
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``): every receiver rank gets the same payload and narrows
its experts and MoE-TP rows out of it. Skips the per-expert loader loop of the compatible path.

It needs an ENGINE-SIDE LOADER: stock SGLang (0.5.23) has no code path for these names (they
reach ``FusedMoE.weight_loader`` without shard or expert ids and raise). The reference receiver
accepts them as a model of such a loader; the format stock SGLang loads with every expert in
one tensor is ``hf_fused`` (:mod:`pytest_weightsync.reference_impl.senders.hf_fused`).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.senders import zerocopy
from pytest_weightsync.reference_impl.model.layout import (
    ExpertWeights,
    MoESpec,
    WeightSyncError,
    fused_name,
    gate_up_halves,
)


def layer_payload(spec: MoESpec, layer: int, experts: Sequence[ExpertWeights], order: str,
                  device=None, alloc=None) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """The layer's payload ``[(w13 name, [E, 2I, H]), (w2 name, [E, H, I])]`` in ``order`` and
    the ``(dst, src)`` pairs still to be copied into it. A tensor whose sources already lie in
    its layout in one storage is a view of them (:func:`zerocopy.expert_grids`: no pairs);
    otherwise it is a staging tensor from ``alloc(shape, dtype, device, zero)`` (default
    ``torch.empty``) that the pairs fill."""
    if len(experts) != spec.num_experts:
        raise WeightSyncError(f"packed export of layer {layer} needs all {spec.num_experts} "
                              f"experts, got {len(experts)}")
    device = experts[0].gate.device if device is None else device
    w13, w2, pairs = zerocopy.stacked_experts(experts, gate_up_halves(order), spec.intermediate,
                                              spec.hidden, spec.dtype, device, alloc)
    return [(fused_name(layer, "w13"), w13), (fused_name(layer, "w2"), w2)], pairs


def export_layer(spec: MoESpec, layer: int, experts: Sequence[ExpertWeights], order: str,
                 device=None, alloc=None) -> list[tuple[str, torch.Tensor]]:
    """``[(w13 name, [E, 2I, H]), (w2 name, [E, H, I])]`` of one layer in ``order``: views of
    the trainer's memory where it already has this layout, else filled staging tensors."""
    entries, pairs = layer_payload(spec, layer, experts, order, device, alloc)
    fastcopy.copy_pairs(pairs)
    return entries


def export(spec: MoESpec, full: Mapping[int, Sequence[ExpertWeights]], order: str,
           layers: Iterable[int] | None = None, device=None,
           alloc=None) -> list[tuple[str, torch.Tensor]]:
    """Packed payload of ``layers`` (default all), layer by layer."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(spec, layer, full[layer], order, device, **zerocopy.staging_kwargs(alloc)))
    return out
