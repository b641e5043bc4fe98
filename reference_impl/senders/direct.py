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

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.senders import zerocopy
from pytest_weightsync.reference_impl.model.layout import (
    ExpertWeights,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    gate_up_halves,
    receiver_shard,
)
from pytest_weightsync.reference_impl.senders.zerocopy import staging_tensor


def layer_payload(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                  experts: Sequence[ExpertWeights], device=None,
                  alloc=None) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """Rank-local ``w13``/``w2`` of one layer for receiver ``rank`` and the ``(dst, src)``
    pairs still to be copied into them. A tensor whose sources already lie in its layout (an
    unpadded rank holding every row, trainer experts in one buffer:
    :func:`zerocopy.tiled_view`) is a view of them; otherwise a staging tensor from
    ``alloc(shape, dtype, device, zero)`` (zeroed where the receiver pads) that the pairs
    fill. ``experts`` holds every expert of the layer, indexed by global expert id."""
    if len(experts) != spec.num_experts:
        raise WeightSyncError(f"direct export of layer {layer} needs all {spec.num_experts} "
                              f"experts (indexed by global id), got {len(experts)}")
    shard = receiver_shard(spec, topo, rank)
    device = experts[0].gate.device if device is None else device
    alloc = alloc or staging_tensor
    n_local, buf, rows = len(shard.experts), shard.buffer_rows, shard.rows
    padded = buf != rows
    lo, hi = shard.row_start, shard.row_start + rows
    w13_shape, w2_shape = (n_local, 2 * buf, spec.hidden), (n_local, spec.hidden, buf)
    w13 = w2 = None
    if not padded:
        halves = gate_up_halves(topo.order)
        held = shard.slot_experts(layer)  # the expert of every slot (EPLB: physical copies)
        w13 = zerocopy.tiled_view([experts[e][p][lo:hi] for e in held for p in halves],
                                  w13_shape, spec.dtype, device)
        w2 = zerocopy.tiled_view([experts[e].down[:, lo:hi] for e in held],
                                 w2_shape, spec.dtype, device)
    stage13, stage2 = w13 is None, w2 is None
    if stage13:
        w13 = alloc(w13_shape, spec.dtype, device, padded)
    if stage2:
        w2 = alloc(w2_shape, spec.dtype, device, padded)
    pairs = []
    for slot, expert in enumerate(shard.slot_experts(layer)):  # every physical copy (EPLB)
        weights = experts[expert]
        if stage13:
            for projection in ("gate", "up"):
                off = shard.half_offset(projection, topo.order)
                pairs.append((w13[slot, off:off + rows], weights[projection][lo:hi]))
        if stage2:
            pairs.append((w2[slot, :, :rows], weights.down[:, lo:hi]))
    return [(fused_name(layer, "w13"), w13), (fused_name(layer, "w2"), w2)], pairs


def export_layer(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                 experts: Sequence[ExpertWeights], device=None) -> list[tuple[str, torch.Tensor]]:
    """Rank-local ``w13``/``w2`` of one layer for receiver ``rank`` (padding zeroed): views of
    the trainer's memory where it already has this layout, else filled staging tensors.
    ``experts`` holds every expert of the layer, indexed by global expert id."""
    entries, pairs = layer_payload(spec, topo, rank, layer, experts, device)
    fastcopy.copy_pairs(pairs)
    if topo.engine_layout == "transposed":  # the rank's parameters are stored transposed
        return [(name, t.transpose(-2, -1).contiguous()) for name, t in entries]
    return entries


def export(spec: MoESpec, topo: ReceiverTopology, rank: int,
           full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None) -> list[tuple[str, torch.Tensor]]:
    """Direct payload for receiver ``rank`` of ``layers`` (default all)."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(spec, topo, rank, layer, full[layer], device))
    return out

