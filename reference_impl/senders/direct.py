"""The direct path: per receiver rank, exactly the tensors its parameters hold.

From the receiver's MoE TP, EP and DP the sender derives the experts and intermediate rows
each rank owns (``layout.receiver_shard``) and builds ``w13_weight [E_local, 2*I_local, H]``
and ``w2_weight [E_local, H, I_local]`` in the rank's native gate/up order and padded shape.
The receiver copies them in with no slicing (SGLang ``load_format="direct"``), so the payload
must match the parameter shapes exactly.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.model.layout import (
    EtpGroupedExperts,
    ExpertWeights,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    gate_up_halves,
    layer_device,
    receiver_shard,
)
from pytest_weightsync.reference_impl.senders.zerocopy import (
    consecutive_span,
    as_shape,
    expert_grids,
    staging_kwargs,
    staging_tensor,
)


def layer_payload(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                  experts: Sequence[ExpertWeights], device=None,
                  alloc=None) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """Rank-local ``w13``/``w2`` of one layer for receiver ``rank`` and the ``(dst, src)``
    pairs still to be copied into them. ``experts`` holds every expert of the layer, indexed
    by global expert id.

    A tensor whose sources already lie in its shape in one storage is a view of them
    (:func:`~pytest_weightsync.reference_impl.senders.zerocopy.expert_grids`: sliced out of a
    :class:`GroupedExperts` layer's buffers, else proven block by block): every
    ``w13`` and ``w2`` of a rank holding every row of a grouped-GEMM trainer's buffers, and
    at MoE-TP > 1 the rank's fc2 columns, a strided view
    ``[E_local, H, rows]`` that ``load_format="direct"`` copies as it is (SGLang's
    ``default_weight_loader`` checks the shape, then ``param.copy_``). Otherwise a staging
    tensor from ``alloc(shape, dtype, device, zero)`` (zeroed where the receiver pads) that
    the pairs fill: strided views of all its blocks where they lie at fixed steps (the rank's
    gate rows of every expert, then its up rows: two batched copies), else one pair per block
    (separate allocations, EPLB's repeated experts).

    ``experts`` may also be an :class:`EtpGroupedExperts` (a trainer's ETP shards, not
    gathered): see :func:`_etp_layer_payload`."""
    if len(experts) != spec.num_experts:
        raise WeightSyncError(f"direct export of layer {layer} needs all {spec.num_experts} "
                              f"experts (indexed by global id), got {len(experts)}")
    if isinstance(experts, EtpGroupedExperts):
        return _etp_layer_payload(spec, topo, rank, layer, experts, device, alloc)
    shard = receiver_shard(spec, topo, rank)
    device = layer_device(experts) if device is None else device
    alloc = alloc or staging_tensor
    n_local, buf, rows = len(shard.experts), shard.buffer_rows, shard.rows
    padded = buf != rows
    lo, hi = shard.row_start, shard.row_start + rows
    w13_shape, w2_shape = (n_local, 2 * buf, spec.hidden), (n_local, spec.hidden, buf)
    halves = gate_up_halves(topo.order)
    held = shard.slot_experts(layer)  # the expert of every slot (EPLB: physical copies)
    # The rank's rows of every block at once: a slice of the blocks' grid, not one per block.
    joined, parts, grid2 = expert_grids(experts, held, halves, spec.dtype, device)
    blocks13 = (n_local, 2, spec.intermediate, spec.hidden)
    if joined is not None and tuple(joined.shape) != blocks13:
        joined = parts = None
    if grid2 is not None and tuple(grid2.shape) != (n_local, spec.hidden, spec.intermediate):
        grid2 = None
    w13 = None if padded or joined is None else as_shape(
        joined[:, :, lo:hi], (n_local, 2, rows, spec.hidden), w13_shape)
    w2 = None if padded or grid2 is None else grid2[:, :, lo:hi]
    pairs = []
    if w13 is None:
        w13 = alloc(w13_shape, spec.dtype, device, padded)
        halves13 = w13.view(n_local, 2, buf, spec.hidden)[:, :, :rows]
        if parts is not None and tuple(parts[0].shape) == blocks13[:1] + blocks13[2:]:
            # per half: each a 2-D strided copy (fastcopy's kernel)
            pairs.extend((halves13[:, half], parts[half][:, lo:hi]) for half in range(2))
        else:
            gate_up = [experts[e][p] for e in held for p in halves]
            cells = itertools.product(range(n_local), range(2))  # (slot, half), as gate_up
            pairs.extend((halves13[slot, half], block[lo:hi])
                         for (slot, half), block in zip(cells, gate_up))
    if w2 is None:
        w2 = alloc(w2_shape, spec.dtype, device, padded)
        if grid2 is not None:
            pairs.append((w2[:, :, :rows], grid2[:, :, lo:hi]))
        else:
            pairs.extend((w2[slot, :, :rows], experts[e].down[:, lo:hi])
                         for slot, e in enumerate(held))
    return [(fused_name(layer, "w13"), w13), (fused_name(layer, "w2"), w2)], pairs


def _etp_layer_payload(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                       experts: EtpGroupedExperts, device, alloc):
    """:func:`layer_payload` from a trainer's ETP shards, without gathering them.

    A receiver rank whose rows are exactly one ETP rank's rows (trainer ETP == engine MoE-TP,
    unpadded, the engine's gate-first order) and whose experts are consecutive gets views:
    ``w13`` is a slice of that rank's fc1 ``[E, 2I/t, H]`` (already ``[gate_r; up_r]`` per
    expert, the exact shape ``load_format="direct"`` checks), ``w2`` of its fc2 - no staging,
    no pairs. Any other combination stages, reading every piece straight from the shards it
    lies in: per overlapping ETP rank and half one strided pair over all the rank's experts
    (or one per expert where they are not consecutive)."""
    if (experts.intermediate != spec.intermediate or experts.hidden != spec.hidden
            or experts.dtype != spec.dtype):
        raise WeightSyncError(
            f"direct export of layer {layer}: the trainer's ETP shards hold intermediate "
            f"{experts.intermediate}, hidden {experts.hidden}, {experts.dtype}; the model is "
            f"{spec.intermediate}, {spec.hidden}, {spec.dtype}")
    shard = receiver_shard(spec, topo, rank)
    device = experts.device if device is None else device
    alloc = alloc or staging_tensor
    n_local, buf, rows = len(shard.experts), shard.buffer_rows, shard.rows
    lo, hidden, step = shard.row_start, spec.hidden, experts.rows
    halves = gate_up_halves(topo.order)
    held = shard.slot_experts(layer)
    span = consecutive_span(held)
    names = (fused_name(layer, "w13"), fused_name(layer, "w2"))
    same_device = torch.device(device) == experts.device
    if (same_device and span is not None and buf == rows == step and lo % step == 0
            and halves == ("gate", "up")):
        fc1, fc2 = experts.shard(lo // step)
        return [(names[0], fc1[span]), (names[1], fc2[span])], []
    padded = buf != rows
    w13 = alloc((n_local, 2 * buf, hidden), spec.dtype, device, padded)
    w2 = alloc((n_local, hidden, buf), spec.dtype, device, padded)
    halves13 = w13.view(n_local, 2, buf, hidden)
    pairs = []
    owners = range(lo // step, (lo + rows - 1) // step + 1) if rows else ()
    for owner in owners:  # the ETP ranks holding the receiver rank's rows
        start, stop = max(lo, owner * step), min(lo + rows, (owner + 1) * step)
        src, dst = slice(start - owner * step, stop - owner * step), slice(start - lo, stop - lo)
        fc2 = experts.shard(owner)[1]
        grid = experts.halves(owner)
        for position, projection in enumerate(halves):
            half = 0 if projection == "gate" else 1
            if span is not None:
                pairs.append((halves13[:, position, dst], grid[span, half, src]))
            else:
                pairs.extend((halves13[slot, position, dst], grid[e, half, src])
                             for slot, e in enumerate(held))
        if span is not None:
            pairs.append((w2[:, :, dst], fc2[span, :, src]))
        else:
            pairs.extend((w2[slot, :, dst], fc2[e, :, src]) for slot, e in enumerate(held))
    return [(names[0], w13), (names[1], w2)], pairs


def export_layer(spec: MoESpec, topo: ReceiverTopology, rank: int, layer: int,
                 experts: Sequence[ExpertWeights], device=None,
                 alloc=None) -> list[tuple[str, torch.Tensor]]:
    """Rank-local ``w13``/``w2`` of one layer for receiver ``rank`` (padding zeroed): views of
    the trainer's memory where it already has this layout, else filled staging tensors.
    ``experts`` holds every expert of the layer, indexed by global expert id."""
    entries, pairs = layer_payload(spec, topo, rank, layer, experts, device, alloc)
    fastcopy.copy_pairs(pairs)
    if topo.engine_layout == "transposed":  # the rank's parameters are stored transposed
        return [(name, _transposed(t, alloc)) for name, t in entries]
    return entries


def _transposed(t: torch.Tensor, alloc=None) -> torch.Tensor:
    """``t`` with its last two dims swapped, contiguous, in memory from ``alloc``."""
    flipped = t.transpose(-2, -1)
    if alloc is None:
        return flipped.contiguous()
    out = alloc(tuple(flipped.shape), t.dtype, t.device, False)
    return out.copy_(flipped)


def export(spec: MoESpec, topo: ReceiverTopology, rank: int,
           full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           device=None, alloc=None) -> list[tuple[str, torch.Tensor]]:
    """Direct payload for receiver ``rank`` of ``layers`` (default all)."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        out.extend(export_layer(spec, topo, rank, layer, full[layer], device, **staging_kwargs(alloc)))
    return out

