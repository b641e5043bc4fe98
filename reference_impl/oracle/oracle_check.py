"""A receiver's parameters checked bit for bit against the synthetic oracle, where they live.

For whole models (40 Qwen3.5-35B-A3B layers are 60 GiB of experts): the expected values are
evaluated on the parameters' device, a batch of experts at a time
(:func:`pytest_weightsync.reference_impl.oracle.synth.expert_blocks`, at the coordinates the layout
model gives each element, never sliced from what a sender produced), and compared as
integers, so no second copy of the model is ever built.

``xor``: a 16-bit pattern applied to every element of the trainer's weights after they were
built (how the end-to-end benchmark changes every weight between updates without rebuilding
60 GiB of them): each element must hold ``synth bits ^ xor``; padding must be zero. The
answer names the first wrong element: parameter, index, (layer, expert, projection, row, col)
and both bit patterns.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    fused_name,
    receiver_shard,
)
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def _signed(pattern: int, bits: int) -> int:
    pattern &= (1 << bits) - 1
    return pattern - (1 << bits) if pattern >= 1 << (bits - 1) else pattern


def first_mismatch(params: Mapping[str, torch.Tensor], spec: MoESpec, topo: ReceiverTopology,
                   rank: int, version: int, seed: int = 0, xor: int = 0) -> Optional[str]:
    """``None`` when every parameter of receiver ``rank`` holds the oracle's bits (``^ xor``)
    and zero padding; else a description of the first element that does not."""
    width = torch.empty((), dtype=spec.dtype).element_size()
    as_int = _INT_OF_WIDTH.get(width)
    if as_int is None or (xor and width != 2):
        raise ValueError(f"cannot compare {spec.dtype} elements as integers with xor={xor:#x}")
    pattern = _signed(xor, 8 * width)
    shard = receiver_shard(spec, topo, rank)
    rows, buf = shard.rows, shard.buffer_rows
    some = next(iter(params.values()))
    device = some.device
    rows_i = torch.arange(shard.row_start, shard.row_start + rows, device=device)
    cols_h = torch.arange(spec.hidden, device=device)
    step = synth.experts_per_batch(rows * spec.hidden)
    n_local = len(shard.experts)

    def compare(name, actual, expected, origin) -> Optional[str]:
        a = actual.view(as_int)
        e = expected.view(as_int) ^ pattern if pattern else expected.view(as_int)
        wrong = a != e
        if not bool(wrong.any()):
            return None
        index = tuple(int(i) for i in wrong.nonzero()[0])
        return _describe(name, origin, index, int(a[index]), int(e[index]), spec, topo, rank, width)

    def zeros(name, actual, origin) -> Optional[str]:
        a = actual.view(as_int)
        wrong = a != 0
        if not bool(wrong.any()):
            return None
        index = tuple(int(i) for i in wrong.nonzero()[0])
        return _describe(name, origin, index, int(a[index]), 0, spec, topo, rank, width)

    for layer in range(spec.num_layers):
        w13_name, w2_name = fused_name(layer, "w13"), fused_name(layer, "w2")
        w13, w2 = params[w13_name], params[w2_name]
        for start in range(0, n_local, step):
            stop = min(n_local, start + step)
            experts = [shard.experts[s] for s in range(start, stop)]
            for projection in ("gate", "up"):
                off = shard.half_offset(projection, topo.order)
                expected = synth.expert_blocks(spec, version, layer, experts, projection,
                                               rows_i, cols_h, seed)
                problem = compare(w13_name, w13[start:stop, off:off + rows], expected,
                                  (start, off, 0))
                if problem is None and buf > rows:
                    problem = zeros(w13_name, w13[start:stop, off + rows:off + buf],
                                    (start, off + rows, 0))
                if problem is not None:
                    return problem
            expected = synth.expert_blocks(spec, version, layer, experts, "down", cols_h,
                                           rows_i, seed)
            problem = compare(w2_name, w2[start:stop, :, :rows], expected, (start, 0, 0))
            if problem is None and buf > rows:
                problem = zeros(w2_name, w2[start:stop, :, rows:buf], (start, 0, rows))
            if problem is not None:
                return problem
    return None


def _describe(name, origin, index, got, want, spec, topo, rank, width) -> str:
    where = tuple(o + i for o, i in zip(origin, index))
    location = locate_receiver_element(spec, topo, rank, name, where)
    mask = (1 << (8 * width)) - 1
    digits = 2 * width
    return (f"receiver rank {rank} {name}[{', '.join(map(str, where))}] ({location}): bits "
            f"0x{got & mask:0{digits}x}, expected 0x{want & mask:0{digits}x}")
