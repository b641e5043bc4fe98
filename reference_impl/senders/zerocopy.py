"""Payload tensors that are views of the trainer's own memory instead of staging copies.

A sender builds each fused payload tensor (``w13 [E, 2I, H]``, ``gate_up_proj``, ...) by
copying source blocks into it in a fixed order. When the trainer already holds those blocks
back to back in one storage, in exactly that order (a grouped-GEMM trainer's one buffer per
layer and projection: :func:`pytest_weightsync.reference_impl.oracle.synth.grouped_full_weights`),
the staging buffer would be a byte-for-byte copy of a region that already exists: the payload
can be a view of that region, and the sync moves every byte once (trainer memory straight into
the engine's parameters) instead of twice.

The check is strict, because a wrong view would send unrelated trainer memory: every source
contiguous, of the payload's dtype and device, of one storage, each starting exactly where the
previous one ended, together exactly the payload's elements; a conjugated or negated view
(lazy bits torch resolves only on copy) never qualifies. Separate allocations are separate
storages even when the allocator places them side by side, so they always take the staging
path. A view aliases the trainer's tensors: it shows the values they hold when the receiver
copies, which is what a synchronous update (the trainer waits for the engine's answer) wants.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pytest_weightsync.reference_impl.kernels.strided_blocks import grid_view


def tiled_view(sources: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
               device=None) -> Optional[torch.Tensor]:
    """A contiguous ``shape`` view of the memory ``sources`` already occupy, or ``None``.

    ``sources`` are the blocks a sender would copy into a contiguous tensor of ``shape``, in
    the order they land in it (block ``k`` right after block ``k - 1``). The view exists when
    the sources are contiguous blocks of one shape lying the same way in one storage (see the
    module docstring); ``device`` (when given) must be theirs, since a copy to another device
    cannot be a view."""
    if not sources or not sources[0].is_contiguous():
        return None
    numel = 1
    for size in shape:
        numel *= int(size)
    block = sources[0].numel()
    if block == 0 or block * len(sources) != numel:
        return None
    stacked = grid_view(sources, (len(sources),), dtype, device)
    if stacked is None or (len(sources) > 1 and stacked.stride(0) != block):
        return None  # blocks with a gap between them
    return stacked.view(tuple(shape))


def staging_tensor(shape, dtype: torch.dtype, device, zero: bool) -> torch.Tensor:
    """A fresh staging tensor for a payload that cannot be a view (zeroed where the receiver
    pads, since no pair writes the padding)."""
    return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)


def stacked_experts(experts: Sequence, halves: tuple[str, str], size: int, hidden: int,
                    dtype: torch.dtype, device, alloc=None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One layer's experts stacked as the fused formats send them: ``[E, 2 * size, hidden]``
    with each expert's ``halves`` rows one after the other, and ``[E, hidden, size]`` of the
    down projections; plus the ``(dst, src)`` pairs still to be copied. Each tensor is a
    view of the trainer's memory where its sources already lie in that layout in one storage
    (:func:`tiled_view`: no pairs), else a staging tensor from ``alloc(shape, dtype, device,
    zero)`` (default :func:`staging_tensor`) that the pairs fill."""
    alloc = alloc or staging_tensor
    n = len(experts)
    up_shape, down_shape = (n, 2 * size, hidden), (n, hidden, size)
    up = tiled_view([w[p] for w in experts for p in halves], up_shape, dtype, device)
    down = tiled_view([w.down for w in experts], down_shape, dtype, device)
    stage_up, stage_down = up is None, down is None
    if stage_up:
        up = alloc(up_shape, dtype, device, False)
    if stage_down:
        down = alloc(down_shape, dtype, device, False)
    pairs = []
    for e, weights in enumerate(experts):
        if stage_up:
            pairs.append((up[e, :size], weights[halves[0]]))
            pairs.append((up[e, size:], weights[halves[1]]))
        if stage_down:
            pairs.append((down[e], weights.down))
    return up, down, pairs
