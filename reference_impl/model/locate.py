"""Where an engine element belongs: the model coordinates of any receiver parameter element.

Failure messages name the first wrong element as (layer, expert, projection, row, col), the
coordinates of the unsharded HF tensor, whatever the engine keeps: the checkpoint layout
(:mod:`.layout`: MoE-TP rows, gate/up halves, padding) or an engine layout that permutes it
(:mod:`.engine_layout`), read back to its checkpoint element first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    gate_up_halves,
    parse_receiver_name,
    receiver_shard,
)


@dataclass(frozen=True)
class Location:
    """Model coordinates of one receiver element. ``row`` / ``col`` index the unsharded HF
    tensor of ``projection``. A zero-padding element (``padding`` True) has no HF
    counterpart: its intermediate coordinate (``row`` of gate/up, ``col`` of down) is
    ``None``."""

    layer: int
    expert: int
    projection: str
    row: Optional[int]
    col: Optional[int]
    rank: Optional[int] = None
    padding: bool = False
    param_index: tuple = field(default=())

    def __str__(self) -> str:
        where = (f"layer={self.layer} expert={self.expert} projection={self.projection} "
                 f"row={self.row} col={self.col}")
        if self.padding:
            where += " (zero padding)"
        if self.rank is not None:
            where += f" receiver_rank={self.rank}"
        return where


def locate_receiver_element(spec: MoESpec, topo: ReceiverTopology, rank: int, name: str,
                            index: tuple) -> Optional[Location]:
    """Model coordinates of ``param[index]`` for receiver parameter ``name`` on ``rank``."""
    parsed = parse_receiver_name(name)
    if parsed is None or parsed.kind != "fused":
        return None
    shard = receiver_shard(spec, topo, rank)
    slot, i, j = (int(x) for x in index)
    if topo.engine_layout != "checkpoint":  # the engine's element -> its checkpoint element
        slot, i, j = engine_layout.checkpoint_index(spec, topo, rank, parsed.projection,
                                                    (slot, i, j))
    expert = shard.logical_expert(parsed.layer, slot)
    if parsed.projection == "w13":
        first, second = gate_up_halves(topo.order)
        half, local_row = divmod(i, shard.buffer_rows)
        projection = first if half == 0 else second
        padding = local_row >= shard.rows
        row = None if padding else shard.row_start + local_row
        col = j
    else:
        projection = "down"
        padding = j >= shard.rows
        row = i
        col = None if padding else shard.row_start + j
    return Location(parsed.layer, expert, projection, row, col, rank, padding, (slot, i, j))
