"""Who owns what on the trainer: Megatron-Core's expert sharding by EP, ETP and PP.

:class:`TrainerTopology` (the parallel sizes that matter for experts, Megatron's default
``tp-cp-ep-dp-pp`` rank order, uneven first pipeline stages), :class:`TrainerShard` (the
layers, experts and fc1/fc2 rows of one rank), the layers of each stage and the rank lists of
each expert group. The receiver side has its own module (:mod:`.receiver_layout`);
:mod:`.layout` re-exports both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pytest_weightsync.reference_impl.model.moe_spec import MoESpec, _require
from pytest_weightsync.vocabulary import EXPERT_IMPLS

__all__ = [
    "TrainerShard",
    "TrainerTopology",
    "stage_layers",
    "trainer_groups",
    "trainer_shard",
    "validate_trainer",
]

@dataclass(frozen=True)
class TrainerTopology:
    """Megatron-Core parallel sizes that matter for experts.

    ``dp`` is the dense data-parallel size; ``None`` picks the smallest one for which the
    expert grid fits (``tp * dp`` divisible by ``etp * ep``). Rank order follows Megatron's
    default ``tp-cp-ep-dp-pp``: within a PP stage the dense TP rank is ``r % tp`` and the
    expert ranks are ``etp_rank = r % etp``, ``ep_rank = (r // etp) % ep``,
    ``edp_rank = r // (etp * ep)``; the PP stage is ``rank // (world_size // pp)``.

    ``first_stage_layers`` (``None``: every stage holds ``num_layers // pp``) gives the first
    pipeline stage that many layers and splits the rest evenly over the other stages, as
    Megatron-Core's ``num_layers_in_first_pipeline_stage`` does (uneven pipelines: a stage
    offset that is not ``stage * num_layers // pp``).
    """

    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    expert_impl: str = "sequential"
    first_stage_layers: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp", "pp"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1,
                     f"TrainerTopology.{name} must be an int >= 1", **{name: value})
        _require(self.expert_impl in EXPERT_IMPLS,
                 f"TrainerTopology.expert_impl must be one of {EXPERT_IMPLS}",
                 expert_impl=self.expert_impl)
        if self.dp is None:
            expert_grid = self.etp * self.ep
            object.__setattr__(self, "dp", math.lcm(self.tp, expert_grid) // self.tp)
        _require(isinstance(self.dp, int) and self.dp >= 1, "TrainerTopology.dp must be >= 1",
                 dp=self.dp)
        _require((self.tp * self.dp) % (self.etp * self.ep) == 0,
                 "ranks per pipeline stage (tp * dp) must be divisible by etp * ep",
                 tp=self.tp, dp=self.dp, etp=self.etp, ep=self.ep)
        first = self.first_stage_layers
        _require(first is None or (isinstance(first, int) and first >= 1 and self.pp > 1),
                 "TrainerTopology.first_stage_layers must be None or an int >= 1 with pp > 1",
                 first_stage_layers=first, pp=self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.etp * self.ep)


@dataclass(frozen=True)
class TrainerShard:
    """What trainer rank ``rank`` holds: global layers, global experts, fc1/fc2 intermediate
    rows ``[row_start, row_start + rows)`` of each of gate, up (fc1) and down columns (fc2)."""

    rank: int
    pp_rank: int
    tp_rank: int
    etp_rank: int
    ep_rank: int
    edp_rank: int
    layers: range
    experts: range
    row_start: int
    rows: int

    def global_layer(self, local_layer: int) -> int:
        return self.layers[local_layer]

    def global_expert(self, local_expert: int) -> int:
        """EP renumbering: ``ep_rank * num_local_experts + local_index``."""
        return self.experts[local_expert]


def validate_trainer(spec: MoESpec, topo: TrainerTopology) -> None:
    _require(spec.num_experts % topo.ep == 0,
             "num_experts must be divisible by the trainer's expert parallel size (ep)",
             num_experts=spec.num_experts, ep=topo.ep)
    _require(spec.intermediate % topo.etp == 0,
             "intermediate must be divisible by the trainer's expert tensor parallel size (etp)",
             intermediate=spec.intermediate, etp=topo.etp)
    stage_layers(spec.num_layers, topo)  # validates


def stage_layers(num_layers: int, topo: TrainerTopology) -> tuple[range, ...]:
    """The global layers of each pipeline stage, in stage order (contiguous runs): an even
    split, or ``topo.first_stage_layers`` on the first stage and the rest split evenly."""
    first = topo.first_stage_layers
    if first is None:
        _require(num_layers % topo.pp == 0,
                 "num_layers must be divisible by the trainer's pipeline parallel size (pp)",
                 num_layers=num_layers, pp=topo.pp)
        sizes = [num_layers // topo.pp] * topo.pp
    else:
        rest = num_layers - first
        _require(rest >= topo.pp - 1 and rest % (topo.pp - 1) == 0,
                 "the layers after the first stage's must split evenly over the other stages",
                 num_layers=num_layers, first_stage_layers=first, pp=topo.pp)
        sizes = [first] + [rest // (topo.pp - 1)] * (topo.pp - 1)
    starts = [sum(sizes[:i]) for i in range(topo.pp)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes))


def trainer_shard(spec: MoESpec, topo: TrainerTopology, rank: int) -> TrainerShard:
    """Ownership of trainer rank ``rank`` (global rank in ``range(topo.world_size)``)."""
    validate_trainer(spec, topo)
    _require(0 <= rank < topo.world_size, "trainer rank must be in range(world_size)",
             rank=rank, world_size=topo.world_size)
    pp_rank, r = divmod(rank, topo.stage_size)
    etp_rank = r % topo.etp
    ep_rank = (r // topo.etp) % topo.ep
    edp_rank = r // (topo.etp * topo.ep)
    experts_per_rank = spec.num_experts // topo.ep
    rows = spec.intermediate // topo.etp
    return TrainerShard(
        rank=rank, pp_rank=pp_rank, tp_rank=r % topo.tp, etp_rank=etp_rank, ep_rank=ep_rank,
        edp_rank=edp_rank,
        layers=stage_layers(spec.num_layers, topo)[pp_rank],
        experts=range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank),
        row_start=etp_rank * rows, rows=rows,
    )


def trainer_groups(spec: MoESpec, topo: TrainerTopology, kind: str) -> list[list[int]]:
    """Rank lists of every ``kind`` group (``"etp"``, ``"ep"``, ``"edp"``, ``"pp"``), in the
    order each group's members are indexed (member i has ``{kind}_rank == i``)."""
    shards = [trainer_shard(spec, topo, r) for r in range(topo.world_size)]
    coords = ("pp_rank", "etp_rank", "ep_rank", "edp_rank")
    member = {"etp": "etp_rank", "ep": "ep_rank", "edp": "edp_rank", "pp": "pp_rank"}
    _require(kind in member, "group kind must be one of etp, ep, edp, pp", kind=kind)
    key_fields = [c for c in coords if c != member[kind]]
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for s in shards:
        key = tuple(getattr(s, c) for c in key_fields)
        groups.setdefault(key, []).append((getattr(s, member[kind]), s.rank))
    return [[rank for _, rank in sorted(members)] for _, members in sorted(groups.items())]
