"""The chunk plan of the owner-balanced BF16 expert gather: pure, deterministic, torch-free.

Every rank of the gather group calls :func:`plan_gather` with the same shard metadata and
gets the same plan, so the ranks agree on every collective without talking about it.

The plan is a sequence of *rounds*. In each round every rank contributes one *slot* of
``slot_bytes`` bytes (the chunks it owns in that round, packed at aligned byte offsets) and one
``all_gather_into_tensor`` of ``world_size * slot_bytes`` bytes hands every rank every slot.
The rank's own slot lives inside the receive buffer (an in-place all_gather), so the bytes alive
for one round are ``world_size * slot_bytes``; with ``max_in_flight`` rounds in flight they are
at most ``max_in_flight * world_size * slot_capacity <= budget_bytes``.

Ownership of the source bytes is fixed by where the shards live. A shard held by several ranks
(replicas, e.g. expert data parallelism) may be sent by any of them: the planner splits shards
into pieces no larger than a slot and gives each piece to one of its holders so that the bytes
each rank sends are balanced. The guarantee (see :meth:`GatherPlan.balance_violations`): no
piece could move from its owner to another holder and reduce the larger of the two totals, so
two ranks that could have exchanged work differ by at most one piece (at most ``slot_capacity``
bytes). When every rank holds every shard the owners' totals differ by at most one piece; when
each shard has a single holder (plain expert parallelism) the totals are what the layout gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pytest_weightsync.reference_impl.errors import WeightSyncError

#: Default byte alignment of chunk offsets inside a slot (fast vectorized copies on GPU).
DEFAULT_ALIGNMENT = 256


class GatherPlanError(WeightSyncError):
    """The shards, budget or world size cannot make a valid gather plan."""


class GatherBudgetError(GatherPlanError):
    """The sync buffer budget is too small for the shards (or not positive)."""


@dataclass(frozen=True)
class ShardSpec:
    """One source tensor of the gather, as the planner sees it.

    ``holders`` are the ranks (of the gather group) that hold an identical copy of it; most
    shards have exactly one holder. ``rows`` is ``shape[0]``; a row is the unit of splitting.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    holders: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class Chunk:
    """Rows ``[row_start, row_stop)`` of shard ``key``, sent by ``owner`` in round ``round``,
    at byte ``offset`` of the owner's slot."""

    owner: int
    key: str
    row_start: int
    row_stop: int
    round: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GatherRound:
    """One collective: every rank contributes ``slot_bytes`` bytes (padding where it has less)."""

    index: int
    slot_bytes: int
    chunks: tuple[Chunk, ...]

    def recv_bytes(self, world_size: int) -> int:
        return self.slot_bytes * world_size


@dataclass(frozen=True)
class GatherPlan:
    world_size: int
    budget_bytes: int
    max_in_flight: int
    slot_capacity: int
    alignment: int
    shards: tuple[ShardSpec, ...]
    rounds: tuple[GatherRound, ...]
    _by_key: dict = field(default=None, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_key", {s.key: s for s in self.shards})

    def shard(self, key: str) -> ShardSpec:
        return self._by_key[key]

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(c for r in self.rounds for c in r.chunks)

    @property
    def buffer_count(self) -> int:
        """Receive buffers the executor keeps: one per round in flight."""
        return min(self.max_in_flight, len(self.rounds))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one receive buffer (the largest round; the rank's staging slot is inside it)."""
        return max((r.recv_bytes(self.world_size) for r in self.rounds), default=0)

    @property
    def peak_bytes(self) -> int:
        """Staging plus receive bytes alive at once when the executor runs this plan."""
        return self.buffer_count * self.buffer_bytes

    def owner_bytes(self) -> tuple[int, ...]:
        """Payload bytes each rank sends."""
        totals = [0] * self.world_size
        for c in self.chunks:
            totals[c.owner] += c.nbytes
        return tuple(totals)

    def balance_violations(self) -> list[str]:
        """Chunks whose move to another holder would reduce the larger owner total.

        Empty for every plan :func:`plan_gather` returns; a non-empty list names each offending
        chunk, its owner, the other holder and both totals.
        """
        totals = self.owner_bytes()
        found = []
        for c in self.chunks:
            for other in self.shard(c.key).holders:
                gap = totals[c.owner] - totals[other]
                if other != c.owner and gap > self.slot_capacity:
                    found.append(
                        f"chunk {c.key}[{c.row_start}:{c.row_stop}] owned by rank {c.owner} "
                        f"({totals[c.owner]} B sent) could go to holder rank {other} "
                        f"({totals[other]} B sent): gap {gap} B > one chunk ({self.slot_capacity} B)"
                    )
        return found


def slot_capacity_for(budget_bytes: int, world_size: int, max_in_flight: int) -> int:
    """Largest slot each rank may fill per round so that in-flight receive buffers fit the budget."""
    return budget_bytes // (max_in_flight * world_size)


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _validate(shards, budget_bytes, world_size, max_in_flight, alignment) -> None:
    for name, value, low in (
        ("world_size", world_size, 1),
        ("max_in_flight", max_in_flight, 1),
        ("alignment", alignment, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise GatherPlanError(f"{name} must be an int >= {low}, got {value!r}")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise GatherBudgetError(f"sync buffer budget must be a positive number of bytes, got {budget_bytes!r}")
    seen = set()
    for s in shards:
        if not isinstance(s, ShardSpec):
            raise GatherPlanError(f"shards must be ShardSpec, got {type(s).__name__}")
        if s.key in seen:
            raise GatherPlanError(f"duplicate shard key {s.key!r}")
        seen.add(s.key)
        if len(s.shape) < 1 or any((not isinstance(d, int)) or d < 0 for d in s.shape):
            raise GatherPlanError(f"shard {s.key!r}: shape must have >= 1 non-negative int dims, got {s.shape}")
        if s.itemsize <= 0:
            raise GatherPlanError(f"shard {s.key!r}: itemsize must be positive, got {s.itemsize}")
        if not s.holders or list(s.holders) != sorted(set(s.holders)):
            raise GatherPlanError(f"shard {s.key!r}: holders must be sorted distinct ranks, got {s.holders}")
        bad = [h for h in s.holders if not 0 <= h < world_size]
        if bad:
            raise GatherPlanError(f"shard {s.key!r}: holder ranks {bad} outside world of size {world_size}")


def _split_rows(spec: ShardSpec, capacity: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``capacity`` bytes each, as even as rows allow."""
    if spec.nbytes == 0:
        return []
    max_rows = capacity // spec.row_bytes
    pieces = -(-spec.rows // max_rows)
    base, extra = divmod(spec.rows, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def _assign_owners(shards, pieces, world_size) -> list[int]:
    """Owner of each piece: largest-first to the least-loaded holder, then move pieces while a
    move lowers the larger of two totals (each move lowers the sum of squared totals, so it ends)."""
    load = [0] * world_size
    owner = [-1] * len(pieces)

    def size(i):
        spec_index, start, stop = pieces[i]
        return (stop - start) * shards[spec_index].row_bytes

    for i in sorted(range(len(pieces)), key=lambda i: (-size(i), i)):
        holders = shards[pieces[i][0]].holders
        owner[i] = min(holders, key=lambda h: (load[h], h))
        load[owner[i]] += size(i)
    moved = True
    while moved:
        moved = False
        for i in range(len(pieces)):
            here = owner[i]
            best = min(shards[pieces[i][0]].holders, key=lambda h: (load[h], h))
            if load[here] - load[best] > size(i):
                load[here] -= size(i)
                load[best] += size(i)
                owner[i] = best
                moved = True
    return owner


def _pack_slots(shards, pieces, capacity, alignment) -> list[list[tuple[int, int, int, int]]]:
    """Pack one owner's pieces, in order, into slots of ``capacity`` bytes.

    Returns slots of (spec_index, row_start, row_stop, offset). A piece that does not fit the
    rest of a slot is cut at a row boundary; consecutive rows of one shard stay one chunk.
    """
    slots: list[list[list[int]]] = [[]]
    used = 0
    for spec_index, start, stop in pieces:
        row_bytes = shards[spec_index].row_bytes
        while start < stop:
            slot = slots[-1]
            last = slot[-1] if slot else None
            contiguous = last is not None and last[0] == spec_index and last[2] == start
            offset = used if contiguous else _align_up(used, alignment)
            if offset + row_bytes > capacity:
                slots.append([])
                used = 0
                continue
            take = min(stop - start, (capacity - offset) // row_bytes)
            if contiguous:
                last[2] += take
            else:
                slot.append([spec_index, start, start + take, offset])
            used = offset + take * row_bytes
            start += take
    return [[tuple(c) for c in slot] for slot in slots if slot]


def plan_gather(
    shards,
    budget_bytes: int,
    world_size: int,
    *,
    max_in_flight: int = 2,
    alignment: int = DEFAULT_ALIGNMENT,
) -> GatherPlan:
    """Plan the gather of ``shards`` across ``world_size`` ranks within ``budget_bytes``.

    Raises :class:`GatherBudgetError` (a ValueError) before anything is allocated when the
    budget is not positive or a single row cannot fit one rank's slot, naming the sizes.
    """
    shards = tuple(shards)
    _validate(shards, budget_bytes, world_size, max_in_flight, alignment)
    capacity = slot_capacity_for(budget_bytes, world_size, max_in_flight)
    for s in shards:
        if s.nbytes and s.row_bytes > capacity:
            raise GatherBudgetError(
                f"shard {s.key!r}: one row is {s.row_bytes} B (shape {s.shape}, {s.dtype}), but a "
                f"budget of {budget_bytes} B over {world_size} ranks with {max_in_flight} chunk(s) "
                f"in flight leaves {capacity} B per rank per chunk "
                f"(needs a budget >= {s.row_bytes * world_size * max_in_flight} B)"
            )
    pieces = [(i, a, b) for i, s in enumerate(shards) for a, b in _split_rows(s, capacity)]
    owners = _assign_owners(shards, pieces, world_size)
    per_rank_slots = [
        _pack_slots(shards, [p for p, o in zip(pieces, owners) if o == rank], capacity, alignment)
        for rank in range(world_size)
    ]
    n_rounds = max((len(s) for s in per_rank_slots), default=0)
    rounds = []
    for k in range(n_rounds):
        chunks = []
        used = 0
        for rank, slots in enumerate(per_rank_slots):
            for spec_index, start, stop, offset in slots[k] if k < len(slots) else ():
                spec = shards[spec_index]
                nbytes = (stop - start) * spec.row_bytes
                chunks.append(Chunk(rank, spec.key, start, stop, k, offset, nbytes))
                used = max(used, offset + nbytes)
        slot_bytes = min(capacity, _align_up(used, alignment))
        rounds.append(GatherRound(k, slot_bytes, tuple(chunks)))
    return GatherPlan(
        world_size=world_size,
        budget_bytes=budget_bytes,
        max_in_flight=max_in_flight,
        slot_capacity=capacity,
        alignment=alignment,
        shards=shards,
        rounds=tuple(rounds),
    )


def merge_shard_metadata(per_rank) -> tuple[ShardSpec, ...]:
    """Turn each rank's list of ``(key, shape, dtype, itemsize)`` into ShardSpecs with holders.

    ``per_rank[r]`` is what rank ``r`` holds (the result of one ``all_gather_object``). A key
    held by several ranks must have the same shape and dtype everywhere; order is first
    appearance in rank order, so every rank derives the same tuple.
    """
    found: dict[str, tuple] = {}
    holders: dict[str, list[int]] = {}
    for rank, entries in enumerate(per_rank):
        for key, shape, dtype, itemsize in entries:
            meta = (tuple(shape), str(dtype), int(itemsize))
            if key in found and found[key] != meta:
                raise GatherPlanError(
                    f"shard {key!r}: rank {holders[key][0]} holds shape {found[key][0]} "
                    f"{found[key][1]} but rank {rank} holds shape {meta[0]} {meta[1]}"
                )
            if key in found and holders[key][-1] == rank:
                raise GatherPlanError(f"shard {key!r} listed twice by rank {rank}")
            found.setdefault(key, meta)
            holders.setdefault(key, []).append(rank)
    return tuple(ShardSpec(k, m[0], m[1], m[2], tuple(holders[k])) for k, m in found.items())
