"""The trainer side: Megatron-Core expert shards, and gathering them back to full HF tensors.

Rank ``r`` of an ETP group holds ``linear_fc1 = [gate_r; up_r]`` (its rows of gate stacked on
its rows of up: *not* a contiguous slice of ``[gate; up]``) and ``linear_fc2 = down[:, cols_r]``.
So gathering fc1 splits every shard in two, gathers the gates, gathers the ups and
concatenates; gathering fc2 concatenates along dim 1. EP ranks hold whole experts, numbered
locally (global id = ``ep_rank * num_local_experts + local``); PP stages hold contiguous
layers, numbered locally from 0 on each stage.

Two forms with the same result: :func:`gather_full_weights` is given every rank's state dict
(single process, for large simulated matrices), :func:`gather_full_weights_dist` runs inside a
``torch.distributed`` job where each rank holds only its own shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.model.layout import (
    ExpertWeights,
    GroupedExperts,
    MoESpec,
    TrainerShard,
    TrainerTopology,
    WeightSyncError,
    megatron_expert_name,
    trainer_groups,
    trainer_shard,
)


class TrainerStateError(WeightSyncError):
    """A trainer state dict lacks an expert parameter or holds one of the wrong shape."""


def trainer_state(spec: MoESpec, topo: TrainerTopology, rank: int,
                  full: Mapping[int, Sequence[ExpertWeights]]) -> dict[str, torch.Tensor]:
    """The expert parameters trainer rank ``rank`` holds, sliced from full HF weights, under
    Megatron names (local layer and local expert numbering)."""
    shard = trainer_shard(spec, topo, rank)
    rows = slice(shard.row_start, shard.row_start + shard.rows)
    state = {}
    for local_layer, layer in enumerate(shard.layers):
        for local_expert, expert in enumerate(shard.experts):
            w = full[layer][expert]
            state[megatron_expert_name(topo.expert_impl, local_layer, local_expert, 1)] = \
                torch.cat([w.gate[rows], w.up[rows]], dim=0)
            state[megatron_expert_name(topo.expert_impl, local_layer, local_expert, 2)] = \
                w.down[:, rows].contiguous()
    return state


def trainer_states(spec: MoESpec, topo: TrainerTopology,
                   full: Mapping[int, Sequence[ExpertWeights]]) -> list[dict[str, torch.Tensor]]:
    """Every trainer rank's expert state dict, in rank order."""
    return [trainer_state(spec, topo, r, full) for r in range(topo.world_size)]


def _fetch(state: Mapping[str, torch.Tensor], name: str, shape: tuple, rank: int) -> torch.Tensor:
    if name not in state:
        raise TrainerStateError(f"trainer rank {rank} has no parameter {name!r}")
    t = state[name]
    if tuple(t.shape) != shape:
        raise TrainerStateError(f"trainer rank {rank} parameter {name!r} has shape "
                                f"{tuple(t.shape)}, expected {shape}")
    return t


def _shard_fc(spec: MoESpec, topo: TrainerTopology, shard: TrainerShard,
              state: Mapping[str, torch.Tensor], local_layer: int, local_expert: int):
    fc1 = _fetch(state, megatron_expert_name(topo.expert_impl, local_layer, local_expert, 1),
                 (2 * shard.rows, spec.hidden), shard.rank)
    fc2 = _fetch(state, megatron_expert_name(topo.expert_impl, local_layer, local_expert, 2),
                 (spec.hidden, shard.rows), shard.rank)
    return fc1, fc2


def merge_etp_shards(fc1_shards: Sequence[torch.Tensor],
                     fc2_shards: Sequence[torch.Tensor]) -> ExpertWeights:
    """Full gate, up and down of one expert from its ETP shards, in ETP-rank order."""
    gates, ups = zip(*(fc1.chunk(2, dim=-2) for fc1 in fc1_shards))
    return ExpertWeights(gate=torch.cat(gates, dim=-2), up=torch.cat(ups, dim=-2),
                         down=torch.cat(list(fc2_shards), dim=-1))


def fc1_targets(fc1: torch.Tensor, row_start: int, rows: int, size: int):
    """Where an ETP rank's fc1 shard ``[gate_r; up_r]`` (rows ``[row_start, row_start + rows)``
    of gate and of up) lands in a full ``[gate; up]`` buffer ``fc1 [..., 2 * size, H]``: its
    first ``rows`` rows at gate's rows, the next ``rows`` at up's - not the shard's ``2 * rows``
    rows side by side, which is what gathering it as a plain slice of ``[gate; up]`` does."""
    return (fc1[..., row_start:row_start + rows, :],
            fc1[..., size + row_start:size + row_start + rows, :])


def _as_one(blocks: Sequence[torch.Tensor], dtype) -> torch.Tensor:
    """``blocks`` as one ``[n, *block]`` tensor: a view where they lie at fixed steps in one
    storage, else one ``torch.stack`` (one launch, where a copy per block is one each)."""
    from pytest_weightsync.reference_impl.kernels.strided_blocks import grid_view

    view = grid_view(blocks, (len(blocks),), dtype)
    return torch.stack(list(blocks)) if view is None else view


def gather_full_weights(spec: MoESpec, topo: TrainerTopology,
                        states: Sequence[Mapping[str, torch.Tensor]]
                        ) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF expert weights of every layer from all trainer ranks' state dicts (single
    process). Replicas (expert data parallel) are identical; EDP rank 0 is read.

    The result lies the way a grouped-GEMM trainer holds its experts: per layer one fc1 buffer
    ``[E, 2I, H]`` (``[gate; up]`` per expert) and one fc2 buffer ``[E, H, I]``, every
    :class:`ExpertWeights` tensor a view into them, so the fused exporters send views of it
    (``senders.zerocopy``) instead of copying again. Every
    shard is checked (name, shape, dtype, device) before anything is copied; the copies are
    batched: an ETP rank's shards of every local expert of a layer move as three strided
    copies (its gate rows, its up rows, its fc2 columns) from one tensor of them - a view where
    they lie at fixed steps in one storage (a grouped trainer buffer), else one ``torch.stack``
    (separate per-expert parameters: one launch, not one copy per expert) - all in one planned
    copy (:func:`fastcopy.copy_pairs`)."""
    from pytest_weightsync.reference_impl.kernels import fastcopy

    if len(states) != topo.world_size:
        raise TrainerStateError(f"expected {topo.world_size} trainer state dicts (one per rank "
                                f"of {topo}), got {len(states)}")
    shards = [trainer_shard(spec, topo, r) for r in range(topo.world_size)]
    size, hidden = spec.intermediate, spec.hidden
    reads = []  # (layer, global experts, shard, fc1 shards, fc2 shards), all checked first
    for etp_group in trainer_groups(spec, topo, "etp"):
        members = [shards[r] for r in etp_group]
        if members[0].edp_rank != 0:
            continue
        for local_layer, layer in enumerate(members[0].layers):
            for s in members:
                pieces = [_shard_fc(spec, topo, s, states[s.rank], local_layer, local_expert)
                          for local_expert in range(len(s.experts))]
                reads.append((layer, s.experts, s, [p[0] for p in pieces], [p[1] for p in pieces]))
    if not reads or not reads[0][3]:
        raise TrainerStateError(f"no expert shards to gather for {topo}")
    first = reads[0][3][0]
    dtype, device = first.dtype, first.device
    for layer, _, s, ones, twos in reads:
        for t in ones + twos:
            if t.dtype != dtype or t.device != device:
                raise TrainerStateError(f"trainer rank {s.rank} layer {layer}: a {t.dtype} shard on "
                                        f"{t.device}; the others are {dtype} on {device}")
    fc1 = {layer: torch.empty((spec.num_experts, 2 * size, hidden), dtype=dtype, device=device)
           for layer in range(spec.num_layers)}
    fc2 = {layer: torch.empty((spec.num_experts, hidden, size), dtype=dtype, device=device)
           for layer in range(spec.num_layers)}
    rows_read: dict = {}
    for layer, experts, s, _, _ in reads:
        for e in experts:
            rows_read[(layer, e)] = rows_read.get((layer, e), 0) + s.rows
    missing = [(layer, e) for layer in range(spec.num_layers) for e in range(spec.num_experts)
               if rows_read.get((layer, e)) != size]
    if missing:
        raise TrainerStateError(f"the trainer ranks' shards do not cover (layer, expert) "
                                f"{missing[:4]} ({len(missing)} in all) exactly once")
    pairs = []
    for layer, experts, s, ones, twos in reads:
        lo, rows = s.row_start, s.rows
        if experts.step == 1 and len(experts):  # every local expert at once
            span = slice(experts[0], experts[-1] + 1)
            g1, g2 = _as_one(ones, dtype), _as_one(twos, dtype)
            gate, up = fc1_targets(fc1[layer][span], lo, rows, size)
            pairs += [(gate, g1[:, :rows]), (up, g1[:, rows:]),
                      (fc2[layer][span, :, lo:lo + rows], g2)]
            continue
        for e, one, two in zip(experts, ones, twos):
            gate, up = fc1_targets(fc1[layer][e], lo, rows, size)
            pairs += [(gate, one[:rows]), (up, one[rows:]), (fc2[layer][e, :, lo:lo + rows], two)]
    with torch.no_grad():
        fastcopy.copy_pairs(pairs)
    return {layer: GroupedExperts(fc1[layer], fc2[layer]) for layer in range(spec.num_layers)}


# --------------------------------------------------------------------------------------------
# torch.distributed form
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerGroups:
    """This rank's expert process groups (``torch.distributed`` group handles) and ownership."""

    shard: TrainerShard
    etp: object
    ep: object
    pp: object

    @classmethod
    def create(cls, spec: MoESpec, topo: TrainerTopology, backend=None) -> "TrainerGroups":
        """Create every ETP, EP and PP group. Collective: every rank of the default group must
        call it, in the same order (``new_group`` requirement)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        if world != topo.world_size:
            raise WeightSyncError(f"torch.distributed world size {world} does not match the "
                                  f"trainer topology's world size {topo.world_size} ({topo})")
        mine = {}
        for kind in ("etp", "ep", "pp"):
            for ranks in trainer_groups(spec, topo, kind):
                group = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    mine[kind] = group
        return cls(trainer_shard(spec, topo, rank), mine["etp"], mine["ep"], mine["pp"])

    def destroy(self) -> None:
        """Destroy this rank's groups. A gloo group keeps threads and sockets until destroyed,
        so a warm rank process that creates groups for test after test must free them."""
        import torch.distributed as dist

        for group in {id(g): g for g in (self.etp, self.ep, self.pp)}.values():
            dist.destroy_process_group(group)

    def __enter__(self) -> "TrainerGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def all_gather_bits(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of a tensor's raw bytes (bit exact for any dtype; gloo lacks some dtypes)."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    raw = tensor.reshape(-1).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, raw, group=group)
    return [o.view(tensor.dtype).reshape(tensor.shape) for o in out]


def gather_full_weights_dist(spec: MoESpec, topo: TrainerTopology,
                             state: Mapping[str, torch.Tensor], groups: TrainerGroups
                             ) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF expert weights of every layer, on every rank, from this rank's shards only:
    all_gather over ETP (split fc1 into gate/up), then over EP (experts), then over PP
    (layers). Three collectives per fc, each over the whole local stack."""
    shard = groups.shard
    n_layers, n_experts = len(shard.layers), len(shard.experts)
    pieces = [[_shard_fc(spec, topo, shard, state, li, ei) for ei in range(n_experts)]
              for li in range(n_layers)]
    fc1 = torch.stack([torch.stack([p[0] for p in row]) for row in pieces])  # [L, e, 2r, H]
    fc2 = torch.stack([torch.stack([p[1] for p in row]) for row in pieces])  # [L, e, H, r]
    return gather_stacked(spec, fc1, fc2, etp=groups.etp, ep=groups.ep, pp=groups.pp)


def gather_stacked(spec: MoESpec, fc1: torch.Tensor, fc2: torch.Tensor, *, etp, ep, pp
                   ) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF expert weights from this rank's stacked local shards ``fc1 [L_stage, e_local,
    2r, H]`` / ``fc2 [L_stage, e_local, H, r]`` over the given ``torch.distributed`` groups
    (any handles: the reference's own or Megatron's ``parallel_state`` ones). The ETP gather
    regroups fc1 (each shard is ``[gate_r; up_r]``) and concatenates fc2 along its partition
    dim (columns); EP ranks' experts follow in EP-rank order (global expert id =
    ``ep_rank * e_local + local``) and PP stages' layers in stage order. ``pp=None`` gathers
    no stages: this stage's layers come back under their stage-local index (stages of
    unequal size cannot be all_gathered as one tensor; the caller joins them)."""
    merged = merge_etp_shards(all_gather_bits(fc1, etp), all_gather_bits(fc2, etp))
    # [L_stage, e_local, ...] -> [L_stage, E, ...] -> [L, E, ...]
    stacked = [torch.cat(all_gather_bits(t, ep), dim=1)
               for t in (merged.gate, merged.up, merged.down)]
    if pp is not None:
        stacked = [torch.cat(all_gather_bits(t, pp), dim=0) for t in stacked]
    gate, up, down = stacked
    layers = spec.num_layers if pp is not None else fc1.shape[0]
    if gate.shape[:2] != (layers, spec.num_experts):
        raise TrainerStateError(f"gathered {tuple(gate.shape[:2])} (layers, experts), the model "
                                f"has ({layers}, {spec.num_experts})")
    return {layer: tuple(ExpertWeights(gate[layer, e], up[layer, e], down[layer, e])
                         for e in range(spec.num_experts))
            for layer in range(layers)}
