"""Multi-rank gathers over NCCL on two GPUs, bit-identical to the CPU expectation.

The gather executors (:mod:`pytest_weightsync.reference_impl.trainer.bf16_gather`, :mod:`pytest_weightsync.reference_impl.trainer.component_gather`,
:func:`pytest_weightsync.reference_impl.trainer.trainer.gather_full_weights_dist`) run their CPU suites over gloo; here
the same code runs over NCCL with one rank per GPU, the way a trainer runs it. Each rank builds
its shards from a seeded generator on the CPU, moves them to its GPU and gathers; the test
process rebuilds the unsharded tensors from the same generator and compares raw bits. The rank
functions are device-generic: tests/test_gpu_suites_cpu.py runs them over gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytestmark = [pytest.mark.gpu(n=2), pytest.mark.weightsync_property("nccl-gather")]

WORLD = 2


def rank_device():
    """This rank's device: ``cuda:<rank>`` under NCCL, ``cpu`` under gloo."""
    from pytest_weightsync.ranks import current

    context = current()
    return "cpu" if context is None else context.device


def random_bits(shape, seed: int):
    """Seeded raw BF16 bits (NaN and inf patterns included: bits are bits)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=gen).to(torch.int16).view(torch.bfloat16)


def assert_bits(actual, expected, where: str) -> None:
    from pytest_weightsync import compare

    compare.assert_bitwise_equal(actual, expected, name=where)


# --------------------------------------------------------------------------------------------
# 1. the ranks marker itself, over NCCL
# --------------------------------------------------------------------------------------------


@pytest.mark.ranks(WORLD)
def test_ranks_marker_runs_one_nccl_rank_per_gpu():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    assert dist.get_backend() == "nccl", dist.get_backend()
    assert rank_device() == f"cuda:{rank}"
    assert torch.cuda.current_device() == rank
    total = torch.full((8,), float(rank + 1), device=rank_device())
    dist.all_reduce(total)
    assert torch.equal(total.cpu(), torch.full((8,), float(sum(range(1, WORLD + 1)))))
    mine = random_bits((64, 48), seed=rank).to(rank_device())
    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    for source, tensor in enumerate(gathered):
        assert_bits(tensor.cpu(), random_bits((64, 48), seed=source), f"all_gather from rank {source}")


# --------------------------------------------------------------------------------------------
# 2. owner-balanced BF16 expert gather
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertCase:
    """Experts of one layer spread over 2 ranks by EP (whole experts) or ETP (fc1 rows
    ``[gate_t; up_t]``, fc2 columns), gathered within ``budget`` bytes of buffers."""

    ep: int
    etp: int
    experts: int
    hidden: int
    ffn: int
    budget: int

    def full(self, expert: int, proj: str):
        shape = (2 * self.ffn, self.hidden) if proj == "fc1" else (self.hidden, self.ffn)
        return random_bits(shape, seed=10_007 * expert + (0 if proj == "fc1" else 1))

    def shard(self, expert: int, proj: str, etp_rank: int):
        import torch

        full = self.full(expert, proj)
        part = self.ffn // self.etp
        cols = slice(etp_rank * part, (etp_rank + 1) * part)
        if proj == "fc1":
            return torch.cat([full[: self.ffn][cols], full[self.ffn:][cols]]).contiguous()
        return full[:, cols].contiguous()

    def local(self, rank: int) -> dict:
        etp_rank, ep_rank = rank % self.etp, (rank // self.etp) % self.ep
        per_rank = self.experts // self.ep
        return {f"e{e}.{proj}.etp{etp_rank}": self.shard(e, proj, etp_rank)
                for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank) for proj in ("fc1", "fc2")}


def gather_experts(case: ExpertCase) -> dict:
    """Rank body: gather every expert shard within the budget on this rank's device; return
    the reassembled unsharded experts (on CPU) and what the executor did."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import gather_bf16, plan_from_local
    from pytest_weightsync.reference_impl.trainer.component_gather import assemble_components, glu_fc1_layout

    torch.set_num_threads(1)
    device = rank_device()
    local = {k: t.to(device) for k, t in case.local(dist.get_rank()).items()}
    plan = plan_from_local(local, case.budget)
    result = gather_bf16(plan, local)
    experts = {}
    for e in range(case.experts):
        fc1 = [result.tensors[f"e{e}.fc1.etp{t}"] for t in range(case.etp)]
        fc2 = [result.tensors[f"e{e}.fc2.etp{t}"] for t in range(case.etp)]
        experts[(e, "fc1")] = assemble_components(fc1, glu_fc1_layout(case.ffn)).cpu()
        experts[(e, "fc2")] = torch.cat(fc2, dim=1).cpu()
    return {"device": str(next(iter(result.tensors.values())).device), "experts": experts,
            "peak": result.stats.peak_buffer_bytes, "rounds": result.stats.rounds, "plan": plan}


def check_expert_gather(case: ExpertCase, results: list, device_prefix: str) -> None:
    assert all(r["plan"] == results[0]["plan"] for r in results), "ranks planned differently"
    for rank, r in enumerate(results):
        assert r["device"].startswith(device_prefix), f"rank {rank} gathered on {r['device']}"
        assert r["peak"] <= case.budget, f"rank {rank} held {r['peak']} B of buffers, budget {case.budget} B"
        for e in range(case.experts):
            for proj in ("fc1", "fc2"):
                assert_bits(r["experts"][(e, proj)], case.full(e, proj), f"rank {rank} expert {e} {proj}")


EXPERT_CASES = [
    pytest.param(ExpertCase(ep=2, etp=1, experts=16, hidden=512, ffn=256, budget=1 << 20), id="ep2-1MiB"),
    pytest.param(ExpertCase(ep=1, etp=2, experts=8, hidden=512, ffn=256, budget=1 << 18), id="etp2-256KiB"),
    pytest.param(ExpertCase(ep=2, etp=1, experts=8, hidden=2048, ffn=512, budget=64 << 20), id="ep2-qwen35-rows-64MiB"),
]


@pytest.mark.parametrize("case", EXPERT_CASES)
def test_bf16_expert_gather_over_nccl_equals_the_cpu_expectation(rank_pool, case):
    results = rank_pool.run(gather_experts, WORLD, case, backend="nccl")
    check_expert_gather(case, results, "cuda")
    assert results[0]["rounds"] >= 1


# --------------------------------------------------------------------------------------------
# 3. component-major TP gathers (GLU fc1, GDN in_proj and conv1d)
# --------------------------------------------------------------------------------------------


def component_layouts():
    from pytest_weightsync.reference_impl.trainer.component_gather import gdn_conv1d_layout, gdn_in_proj_layout, glu_fc1_layout

    # Qwen3.5 GDN: 16 key heads / 32 value heads of dim 128; MoE ffn 512.
    return {
        "gdn_in_proj": (gdn_in_proj_layout(128, 16, 128, 32), (256,)),
        "gdn_conv1d": (gdn_conv1d_layout(128, 16, 128, 32), (1, 4)),
        "glu_fc1": (glu_fc1_layout(512), (2048,)),
    }


def full_component_tensor(name: str, seed: int):
    layout, tail = component_layouts()[name]
    return random_bits((layout.rows, *tail), seed)


def gather_components(seed: int) -> dict:
    """Rank body: this rank's TP shard of each fused tensor, gathered both ways."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.component_gather import gather_components_async, gather_components_sequential, shard_of

    rank, device = dist.get_rank(), rank_device()
    out = {}
    for name, (layout, _) in component_layouts().items():
        shard = shard_of(full_component_tensor(name, seed), layout, WORLD, rank).to(device)
        out[name] = {
            "sequential": gather_components_sequential(shard, layout).cpu(),
            "async": gather_components_async(shard, layout).cpu(),
        }
    return out


def check_component_gather(seed: int, results: list) -> None:
    import torch

    from pytest_weightsync.reference_impl.trainer.component_gather import shard_of

    for name, (layout, _) in component_layouts().items():
        full = full_component_tensor(name, seed)
        naive = torch.cat([shard_of(full, layout, WORLD, r) for r in range(WORLD)])
        assert not torch.equal(naive.view(torch.int16), full.view(torch.int16)), (
            f"{name}: concatenating shards must differ from the component-major gather")
        for rank, r in enumerate(results):
            for form in ("sequential", "async"):
                assert_bits(r[name][form], full, f"{name} gathered {form}ly on rank {rank}")


def test_component_major_gathers_over_nccl_equal_the_cpu_expectation(rank_pool):
    results = rank_pool.run(gather_components, WORLD, 7, backend="nccl")
    check_component_gather(7, results)


# --------------------------------------------------------------------------------------------
# 4. the trainer's full-weight gather (ETP, EP groups) over NCCL
# --------------------------------------------------------------------------------------------


def gather_trainer_weights(spec, topo, version: int) -> dict:
    """Rank body: build the synth weights on the rank's device (the oracle's device path, no
    CPU build copied over), slice this rank's Megatron expert state from them, gather the full
    HF weights through the trainer's process groups."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer

    device = rank_device()
    full = synth.full_weights(spec, version, device=device)
    state = {k: t.to(device) for k, t in
             trainer.trainer_state(spec, topo, dist.get_rank(), full).items()}
    del full
    with trainer.TrainerGroups.create(spec, topo) as groups:
        full = trainer.gather_full_weights_dist(spec, topo, state, groups)
    return {(layer, e, p): w[p].cpu() for layer, experts in full.items()
            for e, w in enumerate(experts) for p in ("gate", "up", "down")}


def check_trainer_gather(spec, version: int, results: list) -> None:
    from pytest_weightsync.reference_impl.oracle import synth

    expected = synth.full_weights(spec, version)
    for rank, got in enumerate(results):
        for (layer, e, p), tensor in got.items():
            assert_bits(tensor, expected[layer][e][p], f"rank {rank} layer {layer} expert {e} {p}_proj")
        assert len(got) == spec.num_layers * spec.num_experts * 3


def trainer_cases():
    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology

    spec = MoESpec(num_layers=2, num_experts=4, hidden=96, intermediate=64)
    return [(spec, TrainerTopology(ep=2)), (spec, TrainerTopology(etp=2)),
            (spec, TrainerTopology(tp=2, etp=2, expert_impl="te_grouped"))]


@pytest.mark.parametrize("index", range(3), ids=["ep2", "etp2", "tp2-etp2-te_grouped"])
def test_trainer_full_weight_gather_over_nccl_equals_synth(rank_pool, index):
    spec, topo = trainer_cases()[index]
    results = rank_pool.run(gather_trainer_weights, WORLD, spec, topo, 5, backend="nccl")
    check_trainer_gather(spec, 5, results)
