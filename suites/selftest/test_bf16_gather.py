"""The owner-balanced BF16 expert gather over real gloo process groups.

Each rank builds the trainer's expert shards of a Megatron-style layout (expert rank
``r = dp * EP * ETP + ep * ETP + etp``; fc1 sharded per component ``[gate_t; up_t]``, fc2 on
dim 1), gathers them within a sync buffer budget, reassembles each expert, and compares the raw
bits with unsharded tensors the test generates itself from a seeded generator. Budgets run
from the smallest that fits one row (many chunks, many rounds) to one that fits everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from .located_bits import assert_expert_bits

from pytest_weightsync.compare import assert_bitwise_equal

pytestmark = pytest.mark.weightsync_property("bf16-gather")

LAYER = 0


@dataclass(frozen=True)
class Case:
    ep: int
    etp: int
    dp: int
    experts: int
    hidden: int
    ffn: int
    budget_rows: int | None  # budget = rows of the widest shard per rank slot; None = plenty

    @property
    def world(self) -> int:
        return self.ep * self.etp * self.dp

    @property
    def widest_row_bytes(self) -> int:
        return 2 * max(self.hidden, self.ffn // self.etp)

    @property
    def budget(self) -> int:
        if self.budget_rows is None:
            return 1 << 20
        return self.budget_rows * self.widest_row_bytes * self.world * 2

    def __str__(self) -> str:
        return f"ep{self.ep}-etp{self.etp}-dp{self.dp}-E{self.experts}-budget{self.budget_rows or 'large'}"


def unsharded(layer: int, expert: int, proj: str, case: Case):
    """The full expert weight: random raw bits (NaNs and infinities included) from a seed."""
    import torch

    shape = (2 * case.ffn, case.hidden) if proj == "fc1" else (case.hidden, case.ffn)
    gen = torch.Generator().manual_seed(1_000_003 * layer + 1009 * expert + (0 if proj == "fc1" else 1))
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=gen).to(torch.int16).view(torch.bfloat16)


def trainer_shard(layer: int, expert: int, proj: str, etp_rank: int, case: Case):
    """What ETP rank ``etp_rank`` holds: ``[gate_t; up_t]`` for fc1, a column block for fc2.

    Built here on purpose rather than taken from ``pytest_weightsync.reference_impl.model.layout``: this is the test's
    independent oracle of Megatron's ETP layout, so a wrong layout in the code under test
    cannot make its own expected values.
    """
    import torch

    full = unsharded(layer, expert, proj, case)
    part = case.ffn // case.etp
    cols = slice(etp_rank * part, (etp_rank + 1) * part)
    if proj == "fc1":
        gate, up = full[: case.ffn], full[case.ffn :]
        return torch.cat([gate[cols], up[cols]]).contiguous()
    return full[:, cols].contiguous()


def shard_key(layer: int, expert: int, proj: str, etp_rank: int) -> str:
    return f"layer{layer}.{proj}.e{expert}.etp{etp_rank}"


def local_shards(rank: int, case: Case) -> dict:
    etp_rank = rank % case.etp
    ep_rank = (rank // case.etp) % case.ep
    per_rank = case.experts // case.ep
    return {
        shard_key(LAYER, g, proj, etp_rank): trainer_shard(LAYER, g, proj, etp_rank, case)
        for g in range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        for proj in ("fc1", "fc2")
    }


def fc1_blocks(case: Case, etp: int = 1) -> tuple:
    """Row blocks of an fc1 tensor (unsharded, or one of ``etp`` shards) for located messages."""
    return (("gate", case.ffn // etp), ("up", case.ffn // etp))


def gather_and_check(case: Case) -> dict:
    """Rank body: gather within the budget, rebuild every expert, compare bits; return stats."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import gather_bf16, plan_from_local
    from pytest_weightsync.reference_impl.trainer.component_gather import assemble_components, glu_fc1_layout

    torch.set_num_threads(1)
    rank = dist.get_rank()
    local = local_shards(rank, case)
    plan = plan_from_local(local, case.budget, alignment=16)
    result = gather_bf16(plan, local)
    for g in range(case.experts):
        for proj in ("fc1", "fc2"):
            shards = [result.tensors[shard_key(LAYER, g, proj, t)] for t in range(case.etp)]
            for t, shard in enumerate(shards):
                assert_expert_bits(shard, trainer_shard(LAYER, g, proj, t, case), layer=LAYER, expert=g, projection=proj,
                                   where=f"rank {rank} etp shard {t}", row_blocks=fc1_blocks(case, case.etp) if proj == "fc1" else ())
            full = assemble_components(shards, glu_fc1_layout(case.ffn)) if proj == "fc1" else torch.cat(shards, dim=1)
            assert_expert_bits(full, unsharded(LAYER, g, proj, case), layer=LAYER, expert=g, projection=proj,
                               where=f"rank {rank} unsharded", row_blocks=fc1_blocks(case) if proj == "fc1" else ())
    return {
        "rounds": result.stats.rounds,
        "peak": result.stats.peak_buffer_bytes,
        "owner_bytes": plan.owner_bytes(),
        "slot_capacity": plan.slot_capacity,
        "violations": plan.balance_violations(),
        "plan": plan,
    }


CASES = [
    pytest.param(Case(ep=2, etp=1, dp=1, experts=4, hidden=12, ffn=8, budget_rows=1), id="2r-ep2-tiny"),
    pytest.param(Case(ep=1, etp=2, dp=1, experts=3, hidden=10, ffn=6, budget_rows=3), id="2r-etp2-small"),
    pytest.param(Case(ep=1, etp=1, dp=2, experts=3, hidden=12, ffn=10, budget_rows=2), id="2r-replicated-small"),
    pytest.param(Case(ep=2, etp=1, dp=1, experts=2, hidden=8, ffn=6, budget_rows=None), id="2r-ep2-large"),
    pytest.param(Case(ep=2, etp=2, dp=1, experts=4, hidden=12, ffn=8, budget_rows=1), id="4r-ep2-etp2-tiny"),
    pytest.param(Case(ep=4, etp=1, dp=1, experts=8, hidden=9, ffn=14, budget_rows=5), id="4r-ep4-small"),
    pytest.param(Case(ep=2, etp=1, dp=2, experts=6, hidden=12, ffn=10, budget_rows=2), id="4r-ep2-dp2-small"),
    pytest.param(Case(ep=2, etp=2, dp=2, experts=4, hidden=8, ffn=8, budget_rows=2), id="8r-ep2-etp2-dp2"),
]


@pytest.mark.parametrize("case", CASES)
def test_gathered_experts_are_bit_identical_within_budget_and_balanced(rank_pool, case):
    results = rank_pool.run(gather_and_check, case.world, case)
    plans = [r["plan"] for r in results]
    assert all(p == plans[0] for p in plans), "ranks computed different plans"
    for rank, r in enumerate(results):
        assert r["peak"] <= case.budget, f"rank {rank} held {r['peak']} B of buffers, budget {case.budget} B"
        assert r["violations"] == [], r["violations"]
    if case.budget_rows == 1:
        assert results[0]["rounds"] > case.experts, "a one-row budget must force many rounds"
    totals = results[0]["owner_bytes"]
    if case.dp == case.world:
        assert max(totals) - min(totals) <= results[0]["slot_capacity"], totals
    elif case.dp == 1:
        assert len(set(totals)) == 1, f"equal expert shards per rank must send equal bytes: {totals}"


def plan_with_budget(budget: int):
    """Rank body: plan within ``budget``; a refusal is returned (type name, message), not
    raised, so every rank's answer is checked and the warm rank pool is kept."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import plan_from_local
    from pytest_weightsync.reference_impl.trainer.gather_plan import GatherBudgetError

    case = Case(ep=2, etp=1, dp=1, experts=2, hidden=12, ffn=8, budget_rows=1)
    try:
        return plan_from_local(local_shards(dist.get_rank(), case), budget)
    except GatherBudgetError as exc:
        return (type(exc).__name__, str(exc))


def test_budget_below_one_row_fails_on_every_rank_before_any_transfer(rank_pool):
    from pytest_weightsync.reference_impl.trainer.gather_plan import GatherPlan

    row, world = 2 * 12, 2
    plans = rank_pool.run(plan_with_budget, world, row * world * 2)
    assert all(isinstance(p, GatherPlan) for p in plans), plans
    refusals = rank_pool.run(plan_with_budget, world, row * world * 2 - 1)
    for rank, refusal in enumerate(refusals):
        assert isinstance(refusal, tuple), f"rank {rank} planned within a budget below one row: {refusal}"
        name, message = refusal
        assert name == "GatherBudgetError", f"rank {rank}: {name}: {message}"
        assert re.search(rf"one row is {row} B.*budget of {row * world * 2 - 1} B", message), f"rank {rank}: {message}"


def gather_with_wrong_local_tensor() -> str:
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import GatherInputError, gather_bf16, plan_from_local

    rank = dist.get_rank()
    case = Case(ep=2, etp=1, dp=1, experts=2, hidden=12, ffn=8, budget_rows=2)
    local = local_shards(rank, case)
    plan = plan_from_local(local, case.budget)
    if rank == 1:
        key = next(iter(local))
        local[key] = local[key].to(torch.float32)
    try:
        gather_bf16(plan, local)
    except GatherInputError as exc:
        return str(exc)
    return "no error"


def test_a_bad_tensor_on_one_rank_fails_every_rank_without_hanging(rank_pool):
    messages = rank_pool.run(gather_with_wrong_local_tensor, 2)
    assert messages[0] == messages[1]
    assert "rank 1: shard 'layer0.fc1.e1.etp0' is ((16, 12), 'float32'), the plan expects ((16, 12), 'bfloat16')" in messages[0]


def gather_flat_buffers(direct):
    """Rank body: sources and outputs as views of flat buffers, the layout the direct path needs."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import plan_from_local, prepare_gather

    case = Case(ep=2, etp=1, dp=1, experts=4, hidden=12, ffn=8, budget_rows=3)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {r: local_shards(r, case) for r in range(world)}
    flat_out = torch.empty(sum(t.numel() for r in shards for t in shards[r].values()), dtype=torch.bfloat16)
    out, at = {}, 0
    for r in range(world):
        for key, t in shards[r].items():
            out[key] = flat_out[at : at + t.numel()].view(t.shape)
            at += t.numel()
    flat_src = torch.cat([t.reshape(-1) for t in shards[rank].values()])
    local, at = {}, 0
    for key, t in shards[rank].items():
        local[key] = flat_src[at : at + t.numel()].view(t.shape)
        at += t.numel()
    prepared = prepare_gather(plan_from_local(local, case.budget, alignment=1), local, out=out, direct=direct)
    result = prepared.run()
    for r in range(world):
        for key, t in shards[r].items():  # the key names layer, projection, expert and ETP shard
            assert_bitwise_equal(result.tensors[key], t, name=f"rank {rank} {key}")
    return result.stats.peak_buffer_bytes, len(prepared.buffers), case.budget


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_flat_buffers_gather_direct_or_staged_to_the_same_bits(rank_pool, direct):
    for peak, buffers, budget in rank_pool.run(gather_flat_buffers, 2, direct):
        assert peak <= budget
        assert (buffers == 0) == direct, "direct gathers hold no sync buffer; staged ones do"


def test_reassembly_check_catches_a_gather_that_concatenates_fc1_shards():
    """The suite's check must fail on ``[gate_0; up_0; gate_1; up_1]`` with a located message."""
    import torch

    case = Case(ep=1, etp=2, dp=1, experts=1, hidden=6, ffn=4, budget_rows=None)
    naive = torch.cat([trainer_shard(LAYER, 0, "fc1", t, case) for t in range(2)])
    with pytest.raises(AssertionError, match=r"first at layer=0 expert=0 projection=fc1\.gate row=2 col=\d+ "):
        assert_expert_bits(naive, unsharded(LAYER, 0, "fc1", case), layer=LAYER, expert=0, projection="fc1",
                           where="unsharded", row_blocks=fc1_blocks(case))
