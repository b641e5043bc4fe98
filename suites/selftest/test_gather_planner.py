"""Properties of the owner-balanced gather plan, over random shard layouts (no torch needed).

Each property is checked from the plan's chunks with arithmetic written here, not with the
planner's own summaries: coverage exactly once, slots inside the budget, owners among the
holders, balance, determinism, and a clear error when one row cannot fit.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_weightsync.reference_impl.trainer.gather_plan import (
    GatherBudgetError,
    GatherPlanError,
    ShardSpec,
    merge_shard_metadata,
    plan_gather,
)

pytestmark = pytest.mark.weightsync_property("bf16-gather-plan")


@st.composite
def layouts(draw, all_hold: bool | None = None):
    """(shards, world_size, max_in_flight, alignment, budget) with a feasible budget."""
    world = draw(st.integers(1, 8))
    n = draw(st.integers(0, 10))
    shards = []
    for i in range(n):
        shape = (draw(st.integers(0, 40)), *draw(st.lists(st.integers(1, 6), min_size=0, max_size=2)))
        itemsize = draw(st.sampled_from([1, 2, 4]))
        if all_hold or (all_hold is None and draw(st.booleans()) and world > 1):
            holders = tuple(range(world)) if all_hold else tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
        else:
            holders = (draw(st.integers(0, world - 1)),)
        shards.append(ShardSpec(f"s{i}", shape, f"int{8 * itemsize}", itemsize, holders))
    in_flight = draw(st.integers(1, 2))
    alignment = draw(st.sampled_from([1, 16, 256]))
    min_slot = max((math.prod(s.shape[1:]) * s.itemsize for s in shards if s.shape[0]), default=1)
    slot = min_slot * draw(st.integers(1, 12)) + draw(st.integers(0, min_slot - 1 if min_slot > 1 else 0))
    budget = slot * world * in_flight + draw(st.integers(0, world * in_flight - 1))
    return shards, world, in_flight, alignment, budget


def _plan(layout):
    shards, world, in_flight, alignment, budget = layout
    return plan_gather(shards, budget, world, max_in_flight=in_flight, alignment=alignment)


def _owner_totals(plan):
    totals = [0] * plan.world_size
    for rnd in plan.rounds:
        for c in rnd.chunks:
            totals[c.owner] += c.nbytes
    return totals


@given(layouts())
def test_every_row_of_every_shard_is_sent_exactly_once(layout):
    plan = _plan(layout)
    for spec in layout[0]:
        row_bytes = math.prod(spec.shape[1:]) * spec.itemsize
        sent = sorted((c.row_start, c.row_stop, c.nbytes) for r in plan.rounds for c in r.chunks if c.key == spec.key)
        covered = 0
        for start, stop, nbytes in sent:
            assert start == covered, f"{spec.key}: rows [{covered}, {start}) missing or overlapping ({sent})"
            assert stop > start and nbytes == (stop - start) * row_bytes, f"{spec.key}: bad chunk {start, stop, nbytes}"
            covered = stop
        expected_rows = spec.shape[0] if row_bytes else 0
        assert covered == expected_rows, f"{spec.key}: covered {covered} of {spec.shape[0]} rows"


@given(layouts())
def test_bytes_alive_at_once_never_exceed_the_budget(layout):
    shards, world, in_flight, _, budget = layout
    plan = _plan(layout)
    for rnd in plan.rounds:
        per_owner: dict[int, list] = {}
        for c in rnd.chunks:
            per_owner.setdefault(c.owner, []).append((c.offset, c.offset + c.nbytes))
        for owner, spans in per_owner.items():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"round {rnd.index}: overlapping chunks of rank {owner}"
            assert spans[-1][1] <= rnd.slot_bytes, f"round {rnd.index}: rank {owner} overflows its slot"
    receive = [r.slot_bytes * world for r in plan.rounds]
    windows = [sum(receive[i : i + in_flight]) for i in range(len(receive))]
    # the executor keeps min(in_flight, rounds) buffers of the largest round's size
    held = min(in_flight, len(receive)) * max(receive, default=0)
    assert max(windows, default=0) <= held <= budget
    assert plan.peak_bytes == held


@given(layouts())
def test_chunks_are_sent_by_a_rank_that_holds_them(layout):
    plan = _plan(layout)
    holders = {s.key: s.holders for s in layout[0]}
    for c in plan.chunks:
        assert c.owner in holders[c.key], f"{c} sent by a rank that does not hold {c.key}"


@given(layouts())
def test_no_chunk_could_move_to_another_holder_and_narrow_the_gap(layout):
    plan = _plan(layout)
    totals = _owner_totals(plan)
    holders = {s.key: s.holders for s in layout[0]}
    for c in plan.chunks:
        for other in holders[c.key]:
            assert totals[c.owner] - totals[other] <= plan.slot_capacity, (
                f"rank {c.owner} sends {totals[c.owner]} B, holder rank {other} of {c.key} sends {totals[other]} B"
            )
    assert plan.balance_violations() == []


@given(layouts(all_hold=True))
def test_replicated_shards_balance_owners_within_one_chunk(layout):
    plan = _plan(layout)
    totals = _owner_totals(plan)
    largest_chunk = max((c.nbytes for c in plan.chunks), default=0)
    assert max(totals) - min(totals) <= largest_chunk, f"owner totals {totals}, largest chunk {largest_chunk}"


@given(layouts())
def test_every_rank_computes_the_same_plan(layout):
    shards, world, *_ = layout
    per_rank = [[(s.key, s.shape, s.dtype, s.itemsize) for s in shards if r in s.holders] for r in range(world)]
    merged = merge_shard_metadata(per_rank)
    assert sorted(merged, key=lambda s: s.key) == sorted(shards, key=lambda s: s.key)
    rebuilt = (merged, *layout[1:])
    assert _plan(rebuilt) == _plan(rebuilt)
    assert _plan(layout) == _plan(layout)


def test_single_holder_layout_keeps_the_owners_it_was_given():
    shards = [ShardSpec(f"e{i}", (10, 4), "bfloat16", 2, (i % 3,)) for i in range(7)]
    plan = plan_gather(shards, budget_bytes=2 * 3 * 80, world_size=3)
    assert _owner_totals(plan) == [3 * 80, 2 * 80, 2 * 80]
    assert {c.key: c.owner for c in plan.chunks} == {f"e{i}": i % 3 for i in range(7)}


def test_projection_larger_than_a_slot_is_split_into_row_chunks():
    shard = ShardSpec("fc1", (100, 8), "bfloat16", 2, (0,))
    plan = plan_gather([shard], budget_bytes=2 * 2 * 16 * 10, world_size=2, alignment=1)
    assert plan.slot_capacity == 160
    assert [(c.row_start, c.row_stop) for c in plan.chunks] == [(i, i + 10) for i in range(0, 100, 10)]
    assert len(plan.rounds) == 10


@pytest.mark.parametrize("world, in_flight", [(1, 1), (2, 2), (8, 2)])
def test_budget_below_one_row_is_rejected_naming_the_sizes(world, in_flight):
    shards = [ShardSpec("layer0.fc1.e3", (16, 24), "bfloat16", 2, (0,))]
    need = 48 * world * in_flight
    plan_gather(shards, need, world, max_in_flight=in_flight)
    with pytest.raises(GatherBudgetError, match=rf"'layer0.fc1.e3'.*48 B.*budget of {need - 1} B.*needs a budget >= {need} B"):
        plan_gather(shards, need - 1, world, max_in_flight=in_flight)


@pytest.mark.parametrize("budget", [0, -5])
def test_budget_that_is_not_positive_is_rejected(budget):
    with pytest.raises(GatherBudgetError, match=f"positive number of bytes, got {budget}"):
        plan_gather([ShardSpec("a", (1, 1), "bfloat16", 2, (0,))], budget, 1)


def test_budget_errors_are_value_errors():
    assert issubclass(GatherBudgetError, ValueError) and issubclass(GatherPlanError, ValueError)


@pytest.mark.parametrize(
    "shards, message",
    [
        ([ShardSpec("a", (2, 2), "bfloat16", 2, (0,))] * 2, "duplicate shard key 'a'"),
        ([ShardSpec("a", (2, 2), "bfloat16", 2, (2,))], r"holder ranks \[2\] outside world of size 2"),
        ([ShardSpec("a", (2, 2), "bfloat16", 2, ())], "holders must be sorted distinct ranks"),
        ([ShardSpec("a", (), "bfloat16", 2, (0,))], "shape must have >= 1"),
    ],
)
def test_malformed_shards_are_rejected_by_name(shards, message):
    with pytest.raises(GatherPlanError, match=message):
        plan_gather(shards, 1 << 20, 2)


def test_conflicting_metadata_between_ranks_is_rejected():
    per_rank = [[("e0", (4, 2), "bfloat16", 2)], [("e0", (4, 3), "bfloat16", 2)]]
    with pytest.raises(GatherPlanError, match=r"'e0': rank 0 holds shape \(4, 2\).*rank 1 holds shape \(4, 3\)"):
        merge_shard_metadata(per_rank)
