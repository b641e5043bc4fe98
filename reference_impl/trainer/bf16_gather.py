"""Run a :mod:`pytest_weightsync.reference_impl.trainer.gather_plan` plan over torch.distributed (gloo or NCCL).

Each round packs the rank's chunks into its slot of a pre-allocated receive buffer, then one
in-place ``all_gather_into_tensor`` fills every slot; up to ``plan.max_in_flight`` rounds are in
flight (async ops) while the previous round is unpacked into the full tensors. Bytes travel as
``uint8``: bits are bits, and gloo moves uint8 for every collective (it rejects int16).

When every owner's chunks of a round lie back to back in its source and in every rank's outputs
(views of flat parameter buffers), the *direct* path sends them point to point from the source
straight into the outputs: no staging or receive buffer and no second copy of any byte.

The result holds, on every rank of the group, every shard bit for bit, plus the number of
staging/receive bytes the executor actually allocated, so a test can hold it to the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.kernels.fastcopy import CopyPlan, plan_copies
from pytest_weightsync.reference_impl.trainer.gather_plan import GatherPlan, GatherPlanError, merge_shard_metadata, plan_gather


class GatherInputError(WeightSyncError):
    """A rank's tensors do not match the plan (raised on every rank, before any transfer)."""


@dataclass(frozen=True)
class GatherStats:
    """What one gather did: ``peak_buffer_bytes`` is the staging plus receive bytes held at once."""

    rounds: int
    peak_buffer_bytes: int
    payload_bytes: int
    wire_bytes: int


@dataclass(frozen=True)
class GatherResult:
    tensors: dict
    stats: GatherStats


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def shard_metadata(local: dict) -> list[tuple]:
    """``(key, shape, dtype, itemsize)`` of each local tensor, the only thing ranks exchange."""
    return [(k, tuple(t.shape), _dtype_name(t), t.element_size()) for k, t in local.items()]


def plan_from_local(local: dict, budget_bytes: int, *, group=None, max_in_flight: int = 2, **kwargs) -> GatherPlan:
    """Exchange shard metadata once (``all_gather_object``) and plan; every rank gets the same plan."""
    world = dist.get_world_size(group)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, shard_metadata(local), group=group)
    shards = merge_shard_metadata(per_rank)
    return plan_gather(shards, budget_bytes, world, max_in_flight=max_in_flight, **kwargs)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _local_problems(plan: GatherPlan, rank: int, local: dict, out: dict) -> list[str]:
    problems = []
    for spec in plan.shards:
        want = (spec.shape, spec.dtype)
        if rank in spec.holders:
            t = local.get(spec.key)
            if t is None:
                problems.append(f"rank {rank}: shard {spec.key!r} is missing (the plan says it holds it)")
            elif (tuple(t.shape), _dtype_name(t)) != want:
                problems.append(f"rank {rank}: shard {spec.key!r} is {(tuple(t.shape), _dtype_name(t))}, the plan expects {want}")
            elif not t.is_contiguous():
                problems.append(f"rank {rank}: shard {spec.key!r} is not contiguous (stride {t.stride()})")
        o = out.get(spec.key)
        if o is not None and ((tuple(o.shape), _dtype_name(o)) != want or not o.is_contiguous()):
            problems.append(
                f"rank {rank}: out[{spec.key!r}] is {(tuple(o.shape), _dtype_name(o))} "
                f"(contiguous={o.is_contiguous()}), needs contiguous {want}"
            )
    for name, given in (("shards", local), ("out", out)):
        unknown = sorted(set(given) - {s.key for s in plan.shards})
        if unknown:
            problems.append(f"rank {rank}: {name} {unknown} are not in the plan")
    return problems


def _agree_on_inputs(problems: list[str], direct_here: bool, group, device) -> bool:
    """Raise the same error on every rank if any rank found a problem, so none waits forever
    in a collective; return whether every rank can go direct. One 8-byte all_reduce, and the
    messages only when something is wrong."""
    flags = torch.tensor([len(problems), 0 if direct_here else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    problem_count, not_direct = flags.tolist()
    if problem_count == 0:
        return not_direct == 0
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    raise GatherInputError("gather inputs do not match the plan: " + "; ".join(p for ps in everyone for p in ps))


def _default_device(local: dict, group) -> torch.device:
    if local:
        return next(iter(local.values())).device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class _RoundWork:
    """Staged round: pack into this rank's slot, one in-place all_gather, unpack every slot."""

    buffer: torch.Tensor  # this round's receive bytes (a view of one of the buffers)
    mine: torch.Tensor  # this rank's slot inside it: the in-place all_gather's input
    pack: CopyPlan
    unpack: CopyPlan

    def start(self, group):
        self.pack.run()
        return [dist.all_gather_into_tensor(self.buffer, self.mine, group=group, async_op=True)]

    def finish(self, handles) -> None:
        for handle in handles:
            handle.wait()
        self.unpack.run()


@dataclass(frozen=True)
class _DirectRound:
    """Direct round: each owner's chunks are one contiguous span in its source and in every
    rank's outputs, so point-to-point sends go from the source straight into the outputs."""

    ops: tuple  # P2POp sends of this rank's span, receives of every other owner's span
    own: CopyPlan  # this rank's own span into its outputs

    def start(self, group):
        handles = dist.batch_isend_irecv(list(self.ops)) if self.ops else []
        self.own.run()
        return handles

    def finish(self, handles) -> None:
        for handle in handles:
            handle.wait()


def _span(views: list) -> torch.Tensor | None:
    """One byte view covering ``views`` if they lie back to back in one storage, else None."""
    first = views[0]
    end = first.data_ptr()
    for v in views:
        if v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or v.data_ptr() != end:
            return None
        end += v.numel()
    return first.as_strided((end - first.data_ptr(),), (1,), first.storage_offset())


@dataclass(frozen=True)
class PreparedGather:
    """A plan bound to its tensors and receive buffers; :meth:`run` performs one gather.

    Everything that costs host time per chunk (views, copy plans) is done once here, so a
    sync loop that gathers the same parameters every step pays only for copies and collectives.
    """

    plan: GatherPlan
    group: object
    rank: int
    tensors: dict
    buffers: tuple
    rounds: tuple

    def run(self) -> GatherResult:
        in_flight: list[tuple] = []
        for work in self.rounds:
            if len(in_flight) == self.plan.max_in_flight:
                done, handles = in_flight.pop(0)
                done.finish(handles)
            in_flight.append((work, work.start(self.group)))
        for done, handles in in_flight:
            done.finish(handles)
        world = self.plan.world_size
        stats = GatherStats(
            rounds=len(self.rounds),
            peak_buffer_bytes=sum(b.untyped_storage().nbytes() for b in self.buffers),
            payload_bytes=sum(c.nbytes for c in self.plan.chunks),
            wire_bytes=sum(r.recv_bytes(world) for r in self.plan.rounds),
        )
        return GatherResult(tensors=self.tensors, stats=stats)


def prepare_gather(
    plan: GatherPlan,
    local: dict,
    *,
    group=None,
    out: dict | None = None,
    device=None,
    check_inputs: bool = True,
    direct: bool | None = None,
) -> PreparedGather:
    """Check inputs, allocate outputs and receive buffers, and bind every chunk's copies.

    ``local`` maps the keys this rank holds to its tensors; ``out`` may give pre-allocated
    contiguous destinations (others are allocated). With ``check_inputs`` the ranks agree on
    the inputs (a small all_reduce) so a bad tensor on one rank fails every rank at once.

    ``direct=None`` goes direct when every rank finds, for every round, each owner's chunks
    back to back in its source and in its outputs (views of flat parameter buffers): then no
    staging or receive buffer is allocated and no byte is copied twice. ``False`` forces the
    staged all_gather path; ``True`` requires the direct one.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if world != plan.world_size:
        raise GatherPlanError(f"plan is for {plan.world_size} ranks, the group has {world}")
    out = dict(out or {})
    device = torch.device(device) if device is not None else _default_device(local, group)
    problems = _local_problems(plan, rank, local, out)
    spans = None if problems or direct is False else _direct_spans(plan, rank, local, out)
    if check_inputs:
        go_direct = _agree_on_inputs(problems, spans is not None, group, device)
    elif problems:
        raise GatherInputError("gather inputs do not match the plan: " + "; ".join(problems))
    else:
        go_direct = spans is not None
    if direct and not go_direct:
        raise GatherInputError("direct gather needs every owner's chunks of a round back to back in its source and outputs on every rank")
    for spec in plan.shards:
        if spec.key not in out:
            out[spec.key] = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
    if go_direct:
        return PreparedGather(plan, group, rank, out, (), tuple(_direct_rounds(plan, rank, spans, group)))
    src = {k: _as_bytes(t) for k, t in local.items()}
    dst = {k: _as_bytes(t) for k, t in out.items()}
    buffers = tuple(torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=device) for _ in range(plan.buffer_count))
    rows = _row_bytes_of(plan)
    rounds = []
    for rnd in plan.rounds:
        buffer = buffers[rnd.index % len(buffers)][: rnd.recv_bytes(world)]
        slots = buffer.view(world, rnd.slot_bytes)
        pack = [(slots[rank, c.offset : c.offset + c.nbytes], src[c.key][rows(c)]) for c in rnd.chunks if c.owner == rank]
        unpack = [(dst[c.key][rows(c)], slots[c.owner, c.offset : c.offset + c.nbytes]) for c in rnd.chunks]
        rounds.append(_RoundWork(buffer, slots[rank], plan_copies(pack, graph=False), plan_copies(unpack, graph=False)))
    return PreparedGather(plan, group, rank, out, buffers, tuple(rounds))


def _row_bytes_of(plan: GatherPlan):
    def rows(chunk) -> slice:
        per_row = plan.shard(chunk.key).row_bytes
        return slice(chunk.row_start * per_row, chunk.row_stop * per_row)

    return rows


def _direct_spans(plan: GatherPlan, rank: int, local: dict, out: dict):
    """Per round, per owner: (source span on the owner or None, output span), or None."""
    if any(s.key not in out for s in plan.shards):
        return None
    rows = _row_bytes_of(plan)
    spans = []
    for rnd in plan.rounds:
        by_owner: dict[int, list] = {}
        for c in sorted(rnd.chunks, key=lambda c: (c.owner, c.offset)):
            by_owner.setdefault(c.owner, []).append(c)
        here = {}
        for owner, chunks in by_owner.items():
            dst = _span([_as_bytes(out[c.key])[rows(c)] for c in chunks])
            src = _span([_as_bytes(local[c.key])[rows(c)] for c in chunks]) if owner == rank else None
            if dst is None or (owner == rank and src is None):
                return None
            here[owner] = (src, dst)
        spans.append(here)
    return spans


def _direct_rounds(plan: GatherPlan, rank: int, spans, group) -> list:
    def peer_rank(r: int) -> int:  # P2POp takes global ranks
        return r if group is None else dist.get_global_rank(group, r)

    rounds = []
    for here in spans:
        ops, own = [], []
        for owner, (src, dst) in here.items():
            if owner == rank:
                ops.extend(dist.P2POp(dist.isend, src, peer_rank(peer), group) for peer in range(plan.world_size) if peer != rank)
                own.append((dst, src))
            else:
                ops.append(dist.P2POp(dist.irecv, dst, peer_rank(owner), group))
        rounds.append(_DirectRound(tuple(ops), plan_copies(own, graph=False)))
    return rounds


def gather_bf16(plan: GatherPlan, local: dict, **kwargs) -> GatherResult:
    """Gather every shard of ``plan`` to every rank of the group, bit for bit, within the budget.

    One-shot form of :func:`prepare_gather` (same keyword arguments) followed by ``run()``.
    """
    return prepare_gather(plan, local, **kwargs).run()
