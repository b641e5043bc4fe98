"""The direct path: per receiver rank, exactly the tensors its parameters hold.

From the receiver's MoE TP, EP and DP the sender derives the experts and intermediate rows
each rank owns (``layout.receiver_shard``) and builds ``w13_weight [E_local, 2*I_local, H]``
and ``w2_weight [E_local, H, I_local]`` in the rank's native gate/up order and padded shape.
The receiver copies them in with no slicing (SGLang ``load_format="direct"``), so the payload
must match the parameter shapes exactly.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl import fastcopy
from pytest_weightsync.reference_impl.layout import (
    ExpertWeights,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    receiver_shard,
)


def export_layer(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                 experts: Sequence[ExpertWeights], device=None) -> list[tuple[str, torch.Tensor]]:
    """Rank-local ``w13``/``w2`` of one layer for receiver ``rank`` (padding zeroed).
    ``experts`` holds every expert of the layer, indexed by global expert id."""
    if len(experts) != spec.num_experts:
        raise WeightSyncError(f"direct export of layer {layer} needs all {spec.num_experts} "
                              f"experts (indexed by global id), got {len(experts)}")
    shard = receiver_shard(spec, topo, rank)
    device = experts[0].gate.device if device is None else device
    n_local, buf, rows = len(shard.experts), shard.buffer_rows, shard.rows
    alloc = torch.zeros if buf != rows else torch.empty
    w13 = alloc((n_local, 2 * buf, spec.hidden), dtype=spec.dtype, device=device)
    w2 = alloc((n_local, spec.hidden, buf), dtype=spec.dtype, device=device)
    lo, hi = shard.row_start, shard.row_start + rows
    pairs = []
    for slot, expert in enumerate(shard.slot_experts(layer)):  # every physical copy (EPLB)
        weights = experts[expert]
        for projection in ("gate", "up"):
            off = shard.half_offset(projection, topo.order)
            pairs.append((w13[slot, off:off + rows], weights[projection][lo:hi]))
        pairs.append((w2[slot, :, :rows], weights.down[:, lo:hi]))
    fastcopy.copy_pairs(pairs)
    if topo.engine_layout == "transposed":  # the rank's parameters are stored transposed
        w13, w2 = w13.transpose(-2, -1).contiguous(), w2.transpose(-2, -1).contiguous()
    return [(fused_name(layer, "w13"), w13), (fused_name(layer, "w2"), w2)]


def export(spec: MoESpec, topo: ReceiverTopology, rank: int,
           full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None) -> list[tuple[str, torch.Tensor]]:
    """Direct payload for receiver ``rank`` of ``layers`` (default all)."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(spec, topo, rank, layer, full[layer], device))
    return out

