"""Payload tensors that are views of the trainer's own memory instead of staging copies.

A sender builds each fused payload tensor (``w13 [E, 2I, H]``, ``gate_up_proj``, ...) by
copying source blocks into it in a fixed order. When the trainer already holds those blocks
back to back in one storage, in exactly that order (a grouped-GEMM trainer's one buffer per
layer and projection: :func:`pytest_weightsync.reference_impl.oracle.synth.grouped_full_weights`),
the staging buffer would be a byte-for-byte copy of a region that already exists: the payload
can be a view of that region, and the sync moves every byte once (trainer memory straight into
the engine's parameters) instead of twice.

A layer built as :class:`~pytest_weightsync.reference_impl.model.moe_spec.GroupedExperts`
declares those buffers, so its views are slices of them, found in O(1) (:func:`expert_grids`);
any other layer's blocks are checked one by one. That check is strict, because a wrong view
would send unrelated trainer memory: every source
contiguous, of the payload's dtype and device, of one storage, each starting exactly where the
previous one ended, together exactly the payload's elements; a conjugated or negated view
(lazy bits torch resolves only on copy) never qualifies. Separate allocations are separate
storages even when the allocator places them side by side, so they always take the staging
path. A view aliases the trainer's tensors: it shows the values they hold when the receiver
copies, which is what a synchronous update (the trainer waits for the engine's answer) wants.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pytest_weightsync.reference_impl.kernels.strided_blocks import grid_view
from pytest_weightsync.reference_impl.model.moe_spec import PROJECTION_INDEX, grouped_buffers


def staging_tensor(shape, dtype: torch.dtype, device, zero: bool) -> torch.Tensor:
    """A fresh staging tensor for a payload that cannot be a view (zeroed where the receiver
    pads, since no pair writes the padding)."""
    return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)


def staging_kwargs(alloc) -> dict:
    """How a format's ``export`` passes ``alloc`` on to its ``export_layer``: not at all when it
    is the default, so the per-layer call keeps the shape it always had (code that wraps
    ``export_layer`` - a profiler, a planted bug - is called as before)."""
    return {} if alloc is None else {"alloc": alloc}


class StagingPool:
    """Staging tensors a sender hands out again update after update, in call order.

    A stateless sender builds each update's payload afresh. Where a payload tensor must be
    staged (direct at MoE-TP > 1: a rank's ``[gate_r; up_r]`` rows), fresh memory each update
    is new addresses each update, and an engine recognises a bucket by its addresses: every
    update it maps new memory, validates and plans again (0 plan-cache hits and 3.3 ms of
    engine host time per layer on an H100, 2026-12-06). The pool gives the ``n``-th request
    since :meth:`rewind` the tensor the ``n``-th request got last time, when it asks for the
    same shape, dtype, device and zeroing (padding is zeroed once: no pair writes it), so an
    update that exports what the last one did stages into the same memory. A tensor is given
    out again only after :meth:`rewind`, which the sender calls once every engine has finished
    the previous update's copies."""

    def __init__(self):
        self._slots: list = []
        self._next = 0

    def rewind(self) -> None:
        """Start the next update: requests get the first tensors again."""
        self._next = 0

    @property
    def handed(self) -> int:
        """Tensors handed out since :meth:`rewind` (a sender tells by it whether an export
        staged anything)."""
        return self._next

    def __call__(self, shape, dtype: torch.dtype, device, zero: bool) -> torch.Tensor:
        index, self._next = self._next, self._next + 1
        key = (tuple(int(s) for s in shape), dtype, torch.device(device), bool(zero))
        if index < len(self._slots) and self._slots[index][0] == key:
            return self._slots[index][1]
        made = staging_tensor(shape, dtype, device, zero)
        if index < len(self._slots):
            self._slots[index] = (key, made)
        else:
            self._slots.append((key, made))
        return made


def expert_grids(experts: Sequence, slots: Sequence[int], halves: tuple[str, str],
                 dtype: torch.dtype, device=None):
    """The blocks of ``experts`` at ``slots`` (a global expert id per payload slot) as strided
    tensors over the trainer's memory, no copy: ``(joined, parts, down)``.

    ``joined [n, 2, I, H]`` holds every slot's ``halves`` one after the other, ``parts`` the
    two halves ``[n, I, H]`` in ``halves`` order, ``down [n, H, I]``; each is ``None`` where
    the blocks are not one strided view (``parts`` can exist without ``joined``: ``halves``
    against the buffer's own order). A :class:`GroupedExperts` layer declares its buffers, so
    a run of consecutive slots is sliced out of them in O(1); any other layer is proven block
    by block (:func:`grid_view`: host work per expert)."""
    found = grouped_buffers(experts, dtype, device)
    span = consecutive_span(slots)
    if found is not None and span is not None:
        fc1, fc2 = found
        n, two_i, hidden = fc1.shape
        grid = fc1.view(n, 2, two_i // 2, hidden)[span]
        parts = [grid[:, PROJECTION_INDEX[p]] for p in halves]
        joined = grid if [PROJECTION_INDEX[p] for p in halves] == [0, 1] else None
        return joined, parts, fc2[span]
    joined = grid_view([experts[e][p] for e in slots for p in halves], (len(slots), 2), dtype,
                       device)
    down = grid_view([experts[e].down for e in slots], (len(slots),), dtype, device)
    if joined is not None:
        return joined, [joined[:, 0], joined[:, 1]], down
    parts = [grid_view([experts[e][p] for e in slots], (len(slots),), dtype, device)
             for p in halves]  # each half at fixed steps, though not the pair (up before gate)
    return None, (None if any(part is None for part in parts) else parts), down


def consecutive_span(slots: Sequence[int]) -> "slice | None":
    """``slots`` as a slice when they are consecutive ascending ids, else ``None``."""
    if not len(slots):
        return None
    if isinstance(slots, range):
        return slice(slots.start, slots.stop) if slots.step == 1 else None
    first, stop = slots[0], slots[0] + len(slots)
    return slice(first, stop) if list(slots) == list(range(first, stop)) else None


def as_shape(grid: "torch.Tensor | None", blocks, shape, contiguous: bool = False
             ) -> "torch.Tensor | None":
    """``grid`` (of shape ``blocks``) as ``shape`` where its strides allow it without a copy
    (then it is the same elements in the same order), else ``None``; ``contiguous``: only a
    view without gaps (a fused payload tensor, which engines may read as one block)."""
    if grid is None or tuple(grid.shape) != tuple(blocks):
        return None
    try:
        view = grid.view(tuple(shape))
    except RuntimeError:
        return None
    return None if contiguous and not view.is_contiguous() else view


def stacked_experts(experts: Sequence, halves: tuple[str, str], size: int, hidden: int,
                    dtype: torch.dtype, device, alloc=None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One layer's experts stacked as the fused formats send them: ``[E, 2 * size, hidden]``
    with each expert's ``halves`` rows one after the other, and ``[E, hidden, size]`` of the
    down projections; plus the ``(dst, src)`` pairs still to be copied. Each tensor is a
    view of the trainer's memory where its sources already lie in that layout in one storage
    (:func:`expert_grids`: no pairs), else a staging tensor from ``alloc(shape, dtype, device,
    zero)`` (default :func:`staging_tensor`) that the pairs fill: one strided pair per half
    where the blocks lie at fixed steps, else one pair per block."""
    alloc = alloc or staging_tensor
    n = len(experts)
    up_shape, down_shape = (n, 2 * size, hidden), (n, hidden, size)
    joined, parts, grid_down = expert_grids(experts, range(n), halves, dtype, device)
    up = as_shape(joined, (n, 2, size, hidden), up_shape, contiguous=True)
    down = as_shape(grid_down, down_shape, down_shape, contiguous=True)
    pairs = []
    if up is None:
        up = alloc(up_shape, dtype, device, False)
        if parts is not None and tuple(parts[0].shape) == (n, size, hidden):
            halves_of = up.view(n, 2, size, hidden)
            pairs.extend((halves_of[:, k], parts[k]) for k in range(2))
        else:
            for e, weights in enumerate(experts):
                pairs.append((up[e, :size], weights[halves[0]]))
                pairs.append((up[e, size:], weights[halves[1]]))
    if down is None:
        down = alloc(down_shape, dtype, device, False)
        if grid_down is not None and tuple(grid_down.shape) == down_shape:
            pairs.append((down, grid_down))
        else:
            pairs.extend((down[e], weights.down) for e, weights in enumerate(experts))
    return up, down, pairs
