"""Many blocks as one strided tensor: a view of the memory they already occupy.

A sender or a gather that moves one block at a time (a per-expert tensor, one ETP rank's rows
of it) pays host work per block - a Python call, a slice, an entry in a copy plan - 512 to 768
times per fused layer tensor. Where the blocks lie in one storage at fixed steps (a
grouped-GEMM trainer's one buffer per layer and projection, experts ``e`` at ``start + e *
step``), they are one strided tensor ``[*grid, *block]``: a payload that needs no copy at all
(``senders.zerocopy.expert_grids``), or the source of one batched copy (a receiver rank's
``[gate_r; up_r]`` rows, an ETP rank's shards of every local expert).

The check is strict, because a wrong view would read unrelated memory: every block of one
storage, one dtype, shape and strides, without lazy conjugate or negative bits, at exactly the
addresses the steps give, inside the storage. Separate allocations are separate storages even
where the allocator placed them side by side, so they never qualify. The attributes are read
in C through ``map`` (tens of nanoseconds a block, where a Python loop of checks costs
microseconds).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch


def grid_view(sources: Sequence[torch.Tensor], grid: Sequence[int], dtype: torch.dtype,
              device=None) -> Optional[torch.Tensor]:
    """A ``[*grid, *block]`` view of the memory ``sources`` already occupy, or ``None``.

    ``sources`` are blocks of one shape, listed in row-major order of ``grid``; the view
    exists when they lie in one storage with the same strides, block ``(i, j, ...)`` at
    ``start + i * s0 + j * s1 + ...`` for one non-negative step per grid dim (see the module
    docstring for the rest of the check). What a sender would copy one block at a time is
    then one strided tensor: a payload that is this view reshaped (``senders.zerocopy``), or
    the source of one batched copy into a staging tensor (a rank's ``[gate_r; up_r]`` rows).

    The check reads each source's attributes once, through ``map``, and compares the address
    list against the one the steps imply: per block tens of nanoseconds, where a per-source
    loop of Python checks cost microseconds (512 blocks per fused ``w13``)."""
    count = 1
    for size in grid:
        count *= int(size)
    if not sources or len(sources) != count:
        return None
    first = sources[0]
    if device is not None and torch.device(device) != first.device:
        want = torch.device(device)
        if not (want.type == first.device.type and want.index is None):
            return None
    try:
        storages = set(map(torch.UntypedStorage.data_ptr, map(torch.Tensor.untyped_storage, sources)))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None  # a tensor without a storage (sparse, nested, a subclass that hides it)
    shape, stride = first.shape, first.stride()
    if (len(storages) != 1 or first.numel() == 0
            or set(map(_DTYPE_SHAPE_LAYOUT, sources)) != {(dtype, shape, torch.strided)}
            or set(map(torch.Tensor.stride, sources)) != {stride}
            or any(map(torch.Tensor.is_conj, sources)) or any(map(torch.Tensor.is_neg, sources))):
        return None
    ptrs = list(map(torch.Tensor.data_ptr, sources))
    elem = first.element_size()
    steps, inner = [], 1
    for size in reversed(tuple(grid)):  # the step of each grid dim, from the blocks that vary it
        steps.append(ptrs[inner] - ptrs[0] if size > 1 else 0)
        inner *= int(size)
    steps.reverse()
    if any(step < 0 or step % elem or (step == 0 and size > 1) for step, size in zip(steps, grid)):
        return None
    if ptrs != _addresses(ptrs[0], tuple(grid), steps):
        return None
    storage = first.untyped_storage()
    base = storage.data_ptr()
    offset = ptrs[0] - base
    strides = tuple(step // elem for step in steps) + tuple(stride)
    sizes = tuple(int(g) for g in grid) + tuple(shape)
    reach = offset // elem + sum((n - 1) * s for n, s in zip(sizes, strides)) + 1
    if offset % elem or reach * elem > storage.nbytes():
        return None
    view = torch.empty(0, dtype=dtype, device=first.device)
    return view.set_(storage, offset // elem, sizes, strides)


#: What every block of a grid must share with the first, read in C (no Python frame per block).
_DTYPE_SHAPE_LAYOUT = operator.attrgetter("dtype", "shape", "layout")


def _addresses(start: int, grid: tuple, steps: list) -> list:
    """Every block's address, row-major over ``grid``."""
    out = [start]
    for size, step in zip(grid, steps):
        out = [p + k * step for p in out for k in range(int(size))]
    return out
