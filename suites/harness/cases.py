"""The cases every suite runs: the topology matrix, distributed cases, Hypothesis strategies.

One place: a topology added here (or returned by a plugin's
``pytest_weightsync_extra_topologies`` hook) reaches every suite that asks for the
``moe_case`` fixture, and - as distributed cases, see :func:`dist_cases_of` - every suite
that asks for ``dcase``.

The full cartesian product of the factors below has tens of thousands of valid members;
:data:`CASES` is a pairwise cover of it (every value pair of any two factors appears in some
case), chosen by a seeded greedy search so the list is stable between runs.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Optional

from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.vocabulary import EXPERT_IMPLS, ORDERS

__all__ = [
    "ANCHORS", "CASES", "Case", "DIST_CASES", "DeliveredCase", "DistCase", "ENGINE_CASES",
    "ENGINE_REPLICAS", "ENGINE_UPDATES", "FP8_CASES", "LIFECYCLE_CASES", "QWEN35_LAYER",
    "REALISTIC", "REPLICA_CASES", "UNEVEN_EP_CASES", "VLLM_LIFECYCLE_CASES",
    "VLLM_UNEVEN_LIFECYCLE_CASES", "case_params", "cases", "dist_case_params",
    "engine_updates", "rebalanced",
]

#: Factor -> values. Sizes kept small (CPU suites).
FACTORS = {
    "t_tp": (1, 2, 4),
    "t_ep": (1, 2, 4, 8),
    "t_etp": (1, 2),
    "t_pp": (1, 2),
    "impl": EXPERT_IMPLS,
    "r_moe_tp": (1, 2, 4),
    "r_moe_ep": (1, 2, 4, 8),
    "r_moe_dp": (1, 2),
    "order": ORDERS,
    "padding": ("none", "even", "blocked"),
    "shape": ("small", "odd", "one_expert"),
}
#: Largest simulated receiver engine (ranks) in the matrix.
MAX_RECEIVER_RANKS = 16


@dataclass(frozen=True)
class Case:
    """One trainer -> receiver sync scenario."""

    spec: MoESpec
    trainer: TrainerTopology
    receiver: ReceiverTopology

    @property
    def id(self) -> str:
        s, t, r = self.spec, self.trainer, self.receiver
        pad = "" if r.intermediate_padded is None else f"-pad{r.intermediate_padded}{r.pad_mode[0]}"
        return (f"L{s.num_layers}E{s.num_experts}H{s.hidden}I{s.intermediate}"
                f"-T.tp{t.tp}ep{t.ep}etp{t.etp}pp{t.pp}{'te' if t.expert_impl == 'te_grouped' else 'seq'}"
                f"-R.tp{r.moe_tp}ep{r.moe_ep}dp{r.moe_dp}{'gu' if r.order == 'gate_up' else 'ug'}{pad}"
                f"{engine_tag(r)}")


def engine_tag(r: ReceiverTopology) -> str:
    """The id suffix of a receiver's engine fields ("" for a checkpoint-layout engine, so the
    ids of the plain matrix never change): ``-trtllm_block``, ``-transposed``, ``-eplbR2`` (and
    ``m`` plus a short digest of an explicit placement), ``-fp8b4x4``, ``-linear_uneven``
    (vLLM's expert placement)."""
    layout = getattr(r, "engine_layout", "checkpoint")
    tag = "" if layout == "checkpoint" else f"-{layout}"
    if getattr(r, "eplb", False):
        tag += f"-eplbR{r.redundant_experts}"
        if r.placement is not None:
            import zlib

            tag += f"m{zlib.crc32(repr(r.placement).encode()) % 10000:04d}"
    if getattr(r, "weight_quant", "none") != "none":
        tag += f"-fp8b{r.quant_block[0]}x{r.quant_block[1]}"
    placement = getattr(r, "expert_placement", "even")
    if placement != "even":
        tag += f"-{placement}"
    return tag


def build_case(t_tp, t_ep, t_etp, t_pp, impl, r_moe_tp, r_moe_ep, r_moe_dp, order, padding,
               shape, hidden=None, scale=1) -> Case:
    """The case of one factor combination; sizes are derived so that it is valid when it can
    be (raises :class:`TopologyError` when it cannot, e.g. one expert with EP > 1)."""
    if shape == "one_expert":
        experts = 1
    else:
        experts = math.lcm(t_ep, r_moe_ep) * (3 if shape == "odd" else 1) * scale
    tp_unit = math.lcm(t_etp, r_moe_tp)
    if padding == "blocked":
        # intermediate divisible by the trainer's ETP but, where possible, not by MoE-TP
        intermediate = t_etp * (2 * r_moe_tp + 1) if shape == "odd" else t_etp * (r_moe_tp + 1)
        intermediate = max(intermediate, 1)
        padded = -(-intermediate // r_moe_tp) + 1
    else:
        intermediate = tp_unit * (3 if shape == "odd" else 2)
        padded = intermediate // r_moe_tp + 2 if padding == "even" else None
    spec = MoESpec(num_layers=2 * t_pp if shape != "one_expert" else t_pp,
                   num_experts=experts,
                   hidden=hidden or (13 if shape == "odd" else 8),
                   intermediate=intermediate)
    trainer = TrainerTopology(tp=t_tp, ep=t_ep, etp=t_etp, pp=t_pp, expert_impl=impl)
    receiver = ReceiverTopology(tp=r_moe_tp * r_moe_ep * r_moe_dp, moe_ep=r_moe_ep,
                                moe_dp=r_moe_dp, order=order, intermediate_padded=padded,
                                pad_mode="blocked" if padding == "blocked" else "even")
    from pytest_weightsync.reference_impl.model.layout import receiver_shard, trainer_shard

    trainer_shard(spec, trainer, 0)  # validates
    receiver_shard(spec, receiver, 0)
    return Case(spec, trainer, receiver)


def _valid(combo: dict) -> bool:
    """Whether :func:`build_case` can realise ``combo`` (cheap: no tensors, no dataclasses).
    Sizes are derived to fit, so only two constraints remain."""
    if combo["r_moe_tp"] * combo["r_moe_ep"] * combo["r_moe_dp"] > MAX_RECEIVER_RANKS:
        return False
    if combo["shape"] == "one_expert" and (combo["t_ep"] > 1 or combo["r_moe_ep"] > 1):
        return False  # one expert cannot be split across EP ranks
    return True


def pairwise_cases(seed: int = 20260501, candidates: int = 40, tries: int = 200) -> list[Case]:
    """A seeded greedy pairwise cover of the valid factor combinations: every value pair of
    any two factors that some valid combination holds appears in some chosen case."""
    names = list(FACTORS)
    rng = random.Random(seed)

    def complete(fixed: dict):
        for _ in range(tries):
            combo = {n: fixed[n] if n in fixed else rng.choice(FACTORS[n]) for n in names}
            if _valid(combo):
                return combo
        return None

    def pairs_of(combo):
        return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = set()
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            if complete({a: va, b: vb}) is not None:
                uncovered.add((a, va, b, vb))
    chosen = []
    while uncovered:
        a, va, b, vb = sorted(uncovered, key=repr)[0]
        pool = [complete({a: va, b: vb}) for _ in range(candidates)]
        best = max((c for c in pool if c is not None), key=lambda c: len(pairs_of(c) & uncovered))
        chosen.append(build_case(**best))
        uncovered -= pairs_of(best)
    return chosen


#: Hand-picked cases that must always run: the recipe-like layout and the edge cases.
ANCHORS = (
    # Qwen3.5-35B-A3B-like recipe scaled down: trainer TP2 PP2 EP4 ETP1, receiver TP2 (EP2).
    build_case(2, 4, 1, 2, "sequential", 1, 2, 1, "gate_up", "none", "small", scale=2),
    # ETP > 1 with EP == 1 (a known wrong-group bug family); MoE-TP 2.
    build_case(2, 1, 2, 1, "te_grouped", 2, 1, 1, "gate_up", "none", "small"),
    # EP-only (DeepEP-style) receiver, up/gate order, padded.
    build_case(1, 2, 1, 1, "sequential", 1, 4, 1, "up_gate", "even", "small"),
    # one expert, everything trivial.
    build_case(1, 1, 1, 1, "sequential", 1, 1, 1, "gate_up", "none", "one_expert"),
    # uneven MoE-TP split with blocked padding: some ranks get fewer (or zero) real rows.
    build_case(1, 1, 1, 1, "sequential", 4, 1, 1, "gate_up", "blocked", "odd"),
    # Square per-rank blocks: hidden == intermediate / moe_tp == intermediate / etp (3 x 3,
    # odd), so a transposed gate/up/down slice keeps its shape and only the values can tell;
    # 3 local experts per rank and 4 layers per update, up/gate order.
    build_case(2, 2, 2, 2, "te_grouped", 2, 2, 1, "up_gate", "none", "odd", hidden=3),
    # hidden == intermediate (3, odd) at moe_tp 1: whole HF tensors are square; padded buffers,
    # 6 local experts per rank, MoE-DP 2.
    build_case(1, 4, 1, 1, "sequential", 1, 2, 2, "gate_up", "even", "odd", hidden=3),
)


def _uneven_case(spec: MoESpec, trainer: TrainerTopology, ep: int) -> Case:
    """A vLLM expert-parallel engine of ``ep`` ranks whose experts do not divide evenly
    (``expert_placement="linear_uneven"``), validated on every rank."""
    from pytest_weightsync.reference_impl.model.layout import receiver_shard, trainer_shard

    receiver = ReceiverTopology(tp=ep, moe_ep=ep, expert_placement="linear_uneven")
    if spec.num_experts % ep == 0:
        raise ValueError(f"{spec.num_experts} experts over EP {ep} is an even placement")
    trainer_shard(spec, trainer, 0)
    for rank in range(ep):
        receiver_shard(spec, receiver, rank)
    return Case(spec, trainer, receiver)


#: vLLM's uneven expert parallelism (``determine_expert_map``, linear: the first ``E % EP``
#: ranks hold one expert more; SGLang refuses ``E % EP != 0``), so local expert counts and
#: parameter shapes differ between engine ranks: a loader or exporter that gives the remainder
#: to the last rank, or computes rank e's first expert as ``e * E // EP``, misplaces experts
#: here and nowhere else. Tiny: 5 experts over EP 2 (3 + 2) from a trainer at EP 5, and 7
#: over EP 4 (2 + 2 + 2 + 1: one rank holds a single expert) from a TP 2 x ETP 2 x PP 2
#: TEGroupedMLP trainer. Part of :data:`CASES` (every loader and exporter that claims the
#: placement, ``Capabilities.expert_placements``); exported for the other suites.
UNEVEN_EP_CASES: tuple[Case, ...] = (
    _uneven_case(MoESpec(num_layers=2, num_experts=5, hidden=8, intermediate=4),
                 TrainerTopology(tp=1, ep=5), 2),
    _uneven_case(MoESpec(num_layers=2, num_experts=7, hidden=6, intermediate=4),
                 TrainerTopology(tp=2, etp=2, pp=2, expert_impl="te_grouped"), 4),
)

CASES: tuple[Case, ...] = ANCHORS + tuple(pairwise_cases()) + UNEVEN_EP_CASES

#: A realistically sized case: every tensor of the suites' matrix is a few KiB, so a bug that
#: shows only at size (a loader staging buckets through a fixed 10 MB buffer and dropping the
#: tail, 32-bit offsets, a chunked copy's last chunk) passes all of them. Two layers of 16
#: experts at hidden 512 x intermediate 384: 18 MiB per layer, 36 MiB per update, one receiver
#: rank holding all of it (the whole update in one bucket is 36 MiB); the trainer shards it
#: TP 2 x EP 2 x ETP 2. Each conformance property runs it once per implementation.
REALISTIC = Case(MoESpec(num_layers=2, num_experts=16, hidden=512, intermediate=384),
                 TrainerTopology(tp=2, ep=2, etp=2), ReceiverTopology(tp=1))
#: One real Qwen3.5-35B-A3B MoE layer (256 experts, hidden 2048, moe_ffn 512: 1.5 GiB in
#: BF16) on one engine rank, trained at EP 4: the GPU suites' size.
QWEN35_LAYER = Case(MoESpec(num_layers=1, num_experts=256, hidden=2048, intermediate=512),
                    TrainerTopology(tp=2, ep=4), ReceiverTopology(tp=1))


# --------------------------------------------------------------------------------------------
# Engine topologies: layouts after loading, redundant experts, FP8 (test_loader's engine_layout)
# --------------------------------------------------------------------------------------------

#: Updates every engine case runs (each checked in the engine's layout).
ENGINE_UPDATES = 3


def _engine_case(spec: MoESpec, receiver: ReceiverTopology) -> Case:
    from pytest_weightsync.reference_impl.model.layout import receiver_shard

    for rank in range(receiver.world_size):
        receiver_shard(spec, receiver, rank)  # validates
    return Case(spec, TrainerTopology(), receiver)


#: Few and tiny (the CPU budget): each engine layout, EPLB with the trivial map and with two
#: copies of one expert on one rank (MoE-TP 2), FP8 blocks.
ENGINE_CASES: tuple[Case, ...] = (
    # TRT-LLM BF16 block layout: MoE-TP 2 x EP 2, intermediate 160 padded to 128 per rank
    # (rank 0 takes rows 0..127, rank 1 rows 128..159 and zeros), hidden 64.
    _engine_case(MoESpec(1, 4, 64, 160),
                 ReceiverTopology(tp=4, moe_ep=2, order="up_gate", intermediate_padded=128,
                                  pad_mode="blocked", engine_layout="trtllm_block")),
    # triton_kernels: transposed parameters, MoE-TP 2 x EP 2, padded buffers.
    _engine_case(MoESpec(2, 4, 5, 8),
                 ReceiverTopology(tp=4, moe_ep=2, intermediate_padded=6,
                                  engine_layout="transposed")),
    # EPLB, SGLang's trivial map: 4 logical experts in 6 physical slots over EP 2.
    _engine_case(MoESpec(2, 4, 8, 4), ReceiverTopology(tp=2, moe_ep=2, redundant_experts=2)),
    # EPLB, an explicit map with two copies of one expert on one rank, MoE-TP 2, up/gate.
    _engine_case(MoESpec(2, 3, 5, 4),
                 ReceiverTopology(tp=4, moe_ep=2, order="up_gate", redundant_experts=1,
                                  placement=((2, 2, 0, 1), (1, 0, 2, 0)))),
)


#: FP8 block-quantized engines (SGLang Fp8MoEMethod): 4 x 4 blocks with a partial last block
#: column (hidden 10), MoE-TP 2 x EP 2; and SGLang's default 128 x 128 blocks.
FP8_CASES: tuple[Case, ...] = (
    _engine_case(MoESpec(1, 4, 10, 16),
                 ReceiverTopology(tp=4, moe_ep=2, weight_quant="fp8_block", quant_block=(4, 4))),
    _engine_case(MoESpec(1, 2, 128, 256),
                 ReceiverTopology(tp=2, weight_quant="fp8_block", quant_block=(128, 128))),
)


# --------------------------------------------------------------------------------------------
# The update lifecycle (test_lifecycle): few and tiny, the CPU budget
# --------------------------------------------------------------------------------------------

#: vLLM-shaped engines (``vllm_layout.vllm_topology(receiver)`` is not None: MoE-EP 1 or all
#: ranks, no MoE-DP, unpadded, gate first, checkpoint layout), so a loader restricted to vLLM
#: topologies (``docs/vllm.md``) is judged on every lifecycle property: expert parallelism
#: across all ranks (vLLM ``tp 2`` with ``enable_expert_parallel``: 2 experts a rank) and MoE-TP
#: over all ranks (vLLM ``tp 2 x dp 2`` without expert parallelism, DP flattened into MoE-TP 4:
#: 2 rows a rank). Two layers each, so a bucket of one layer is a partial update.
VLLM_LIFECYCLE_CASES: tuple[Case, ...] = (
    _engine_case(MoESpec(2, 4, 8, 4), ReceiverTopology(tp=2, moe_ep=2)),
    _engine_case(MoESpec(2, 4, 8, 8), ReceiverTopology(tp=4)),
)
#: vLLM's uneven expert parallelism (``E % EP != 0``: ``determine_expert_map`` gives the first
#: ``E % EP`` ranks one expert more) for the lifecycle properties: the smallest engine of the
#: matrix's :data:`UNEVEN_EP_CASES` (5 experts over EP 2: 3 + 2), without its trainer (the
#: lifecycle feeds the engine from the oracle).
VLLM_UNEVEN_LIFECYCLE_CASES: tuple[Case, ...] = tuple(
    _engine_case(case.spec, case.receiver) for case in UNEVEN_EP_CASES[:1])
#: Engines the lifecycle properties drive: a checkpoint-layout engine of 4 ranks (MoE-TP 2 x
#: EP 2, 2 layers of 4 experts, so a bucket of one layer is a partial update), the TRT-LLM
#: BF16 block engine of :data:`ENGINE_CASES` (post-load processing after every update), and
#: the vLLM-shaped engines.
LIFECYCLE_CASES: tuple[Case, ...] = (
    build_case(1, 2, 1, 1, "sequential", 2, 2, 1, "gate_up", "none", "small", scale=2),
    ENGINE_CASES[0],
    *VLLM_LIFECYCLE_CASES,
    *VLLM_UNEVEN_LIFECYCLE_CASES,
)
#: Engines whose ranks share shards, for ``coverage_by_rank``, each fed as
#: :data:`ENGINE_REPLICAS` engines: MoE-TP 2 x DP 2 (up/gate) and EP 2 x DP 2 (MoE-DP replicas
#: inside each engine, SGLang's), and the vLLM-shaped engines, which have no MoE-DP: there the
#: replicas are the whole engine replicas (vLLM's data-parallel engines).
REPLICA_CASES: tuple[Case, ...] = (
    build_case(1, 2, 1, 1, "sequential", 2, 1, 2, "up_gate", "none", "small"),
    build_case(1, 2, 1, 1, "sequential", 1, 2, 2, "gate_up", "none", "small", scale=2),
    *VLLM_LIFECYCLE_CASES,
    *VLLM_UNEVEN_LIFECYCLE_CASES,
)
#: Data-parallel engine replicas each ``coverage_by_rank`` case feeds (separate parameter sets
#: of the same topology, their buckets interleaved).
ENGINE_REPLICAS = 2


def rebalanced(receiver: ReceiverTopology, spec: MoESpec, step: int) -> ReceiverTopology:
    """``receiver`` after the engine's ``step``-th rebalance (EPLB only; others unchanged):
    every layer's physical -> logical map rotated by ``step`` slots and its logical ids
    shifted by ``step``, so most slots change their expert (a loader that keeps the first map
    writes wrong experts) and some move between EP ranks."""
    if not receiver.eplb or step == 0:
        return receiver
    from dataclasses import replace

    rows = receiver.physical_to_logical(spec)
    moved = tuple(tuple((row[(p + step) % len(row)] + step) % spec.num_experts
                        for p in range(len(row)))
                  for row in rows)
    return replace(receiver, placement=moved)


def engine_updates(case: Case) -> list[tuple[int, Case]]:
    """``(version, case of that update)`` for the :data:`ENGINE_UPDATES` updates of an engine
    case: versions 1, 2, 3; an EPLB engine rebalanced before every update after the first."""
    from dataclasses import replace

    return [(step + 1, replace(case, receiver=rebalanced(case.receiver, case.spec, step)))
            for step in range(ENGINE_UPDATES)]


class DeliveredCase:
    """A scenario around a topology case (``self.case``: expert-only or whole-model): its
    model, trainer, engine and trainer world are the case's; the scenario adds how it is
    delivered."""

    @property
    def spec(self):
        return self.case.spec

    @property
    def trainer(self) -> TrainerTopology:
        return self.case.trainer

    @property
    def receiver(self) -> ReceiverTopology:
        return self.case.receiver

    @property
    def world(self) -> int:
        return self.case.trainer.world_size


@dataclass(frozen=True)
class DistCase(DeliveredCase):
    """One distributed-export scenario: a topology case, how the streams are delivered
    (``pytest_weightsync.vocabulary.DELIVERIES``) and the bucket limit the exporter is given."""

    case: Case
    delivery: str
    bucket_bytes: Optional[int]

    @property
    def id(self) -> str:
        b = "all" if self.bucket_bytes is None else self.bucket_bytes
        return f"{self.case.id}-{self.delivery}-b{b}"


def case_params(extra=()) -> list:
    """``pytest.param`` list of :data:`CASES` plus ``extra`` cases, with readable ids."""
    return unique_params((*CASES, *extra))


def unique_params(items) -> list:
    """``pytest.param(item, id=item.id)`` of each item whose id was not seen before."""
    import pytest

    seen, out = set(), []
    for item in items:
        if item.id not in seen:
            seen.add(item.id)
            out.append(pytest.param(item, id=item.id))
    return out


# --------------------------------------------------------------------------------------------
# Distributed-export cases (real trainer ranks)
# --------------------------------------------------------------------------------------------

#: Trainer world size of every built-in distributed case: one warm pool serves them all.
DIST_WORLD = 4


def dist_case(tp, ep, etp, pp, impl, r_tp, r_ep, *, experts, order="gate_up", padded=False,
              delivery="colocated", bucket="whole", layers_per_stage=1, hidden=8,
              world=DIST_WORLD) -> DistCase:
    """A distributed case of ``world`` trainer ranks; ``bucket`` is a name of
    ``vocabulary.BUCKET_LIMITS`` (derived from the model size) or an int."""
    from .inputs import bucket_bytes

    stage = world // pp
    trainer = TrainerTopology(tp=tp, ep=ep, etp=etp, pp=pp, dp=stage // tp, expert_impl=impl)
    moe_tp = r_tp // r_ep
    intermediate = math.lcm(etp, moe_tp) * 2
    receiver = ReceiverTopology(tp=r_tp, moe_ep=r_ep, order=order,
                                intermediate_padded=intermediate // moe_tp + 2 if padded else None)
    spec = MoESpec(num_layers=pp * layers_per_stage, num_experts=experts, hidden=hidden,
                   intermediate=intermediate)
    from pytest_weightsync.reference_impl.model.layout import receiver_shard, trainer_shard

    trainer_shard(spec, trainer, 0)  # validates
    receiver_shard(spec, receiver, 0)
    return DistCase(Case(spec, trainer, receiver), delivery, bucket_bytes(bucket, spec))


#: The built-in distributed cases, all in :data:`DIST_WORLD` ranks. Chosen so that placement
#: bugs show: every trainer EP rank and every engine EP rank holds >= 2 experts (so blocked
#: and round-robin / interleaved expert numbering disagree wherever EP > 1); ETP 2 for every
#: (expert module, delivery) pair, with the dense TP size both equal to and different from the
#: ETP size (a gather over the dense-TP group then shows, also with EP 1 - the verl bug);
#: trainer and engine EP sizes that differ, an expert count (6) that is not a power of two,
#: TP 1-4, PP 1-2, both gate/up orders, padded receivers, every named bucket limit; and one
#: where every trainer rank's shards are its colocated engine rank's direct parameters
#: (trainer ETP 2 and EP 2 = engine MoE-TP 2 and EP 2: TP-local direct loading, no gather).
DIST_CASES = (
    dist_case(1, 2, 2, 1, "sequential", 4, 4, experts=8),
    dist_case(2, 2, 2, 1, "te_grouped", 2, 2, experts=4, order="up_gate", bucket="split_layer"),
    dist_case(4, 2, 2, 1, "sequential", 4, 1, experts=4, delivery="distributed", bucket="tensor"),
    dist_case(1, 1, 2, 2, "te_grouped", 2, 2, experts=4, padded=True, delivery="distributed",
              bucket="multi_layer", layers_per_stage=2),
    dist_case(4, 1, 2, 1, "te_grouped", 2, 1, experts=4, order="up_gate", bucket="split_layer"),
    dist_case(1, 4, 1, 1, "sequential", 2, 2, experts=8, padded=True),
    dist_case(2, 4, 1, 1, "te_grouped", 4, 4, experts=8, delivery="distributed", bucket="tensor"),
    dist_case(1, 2, 1, 2, "sequential", 4, 2, experts=4, order="up_gate", delivery="distributed",
              bucket="split_layer", layers_per_stage=2),
    dist_case(2, 1, 1, 2, "te_grouped", 1, 1, experts=4, bucket="multi_layer"),
    dist_case(2, 2, 1, 2, "sequential", 2, 1, experts=4, padded=True),
    dist_case(1, 2, 2, 1, "te_grouped", 3, 3, experts=6, delivery="distributed",
              bucket="split_layer", hidden=6),
    dist_case(1, 2, 2, 1, "te_grouped", 4, 2, experts=4, bucket="split_layer"),
)


def dist_cases_of(case: Case) -> tuple:
    """The distributed cases an extra topology stands for: both deliveries, the bucket limit
    that splits a layer's experts over buckets."""
    from pytest_weightsync.vocabulary import DELIVERIES

    from .inputs import bucket_bytes

    return tuple(DistCase(case, delivery, bucket_bytes("split_layer", case.spec))
                 for delivery in DELIVERIES)


def dist_case_params(extra=()) -> list:
    """``pytest.param`` list of :data:`DIST_CASES` plus the distributed cases of ``extra``
    (:class:`DistCase` items as they are, :class:`Case` items through :func:`dist_cases_of`)."""
    expanded = [d for item in extra
                for d in ((item,) if isinstance(item, DistCase) else dist_cases_of(item))]
    return unique_params((*DIST_CASES, *expanded))


# --------------------------------------------------------------------------------------------
# Hypothesis strategies
# --------------------------------------------------------------------------------------------


def cases():
    """Strategy of valid :class:`Case` values: factors drawn freely, sizes drawn within the
    constraints the factors impose (so no draw is rejected)."""
    from hypothesis import strategies as st

    @st.composite
    def _case(draw):
        t_ep = draw(st.sampled_from((1, 2, 4)))
        r_moe_ep = draw(st.sampled_from((1, 2, 4)))
        t_etp = draw(st.sampled_from((1, 2)))
        r_moe_tp = draw(st.sampled_from((1, 2, 4)))
        r_moe_dp = draw(st.sampled_from((1, 2)))
        t_tp = draw(st.sampled_from((1, 2, 4)))
        t_pp = draw(st.sampled_from((1, 2)))
        experts = math.lcm(t_ep, r_moe_ep) * draw(st.integers(1, 3))
        pad_mode = draw(st.sampled_from(("none", "even", "blocked")))
        if pad_mode == "blocked":
            intermediate = t_etp * draw(st.integers(1, 8))
            padded = -(-intermediate // r_moe_tp) + draw(st.integers(0, 3))
        else:
            intermediate = math.lcm(t_etp, r_moe_tp) * draw(st.integers(1, 4))
            padded = (intermediate // r_moe_tp + draw(st.integers(1, 3))
                      if pad_mode == "even" else None)
        # a third of the draws make per-rank blocks square (hidden == rows per MoE-TP rank):
        # a transposition keeps the shape there, so only the values can show it
        square = max(1, intermediate // r_moe_tp)
        hidden = draw(st.one_of(st.just(square), st.integers(1, 17), st.integers(1, 17)))
        spec = MoESpec(num_layers=t_pp * draw(st.integers(1, 2)), num_experts=experts,
                       hidden=hidden, intermediate=intermediate)
        trainer = TrainerTopology(tp=t_tp, ep=t_ep, etp=t_etp, pp=t_pp,
                                  expert_impl=draw(st.sampled_from(EXPERT_IMPLS)))
        receiver = ReceiverTopology(tp=r_moe_tp * r_moe_ep * r_moe_dp, moe_ep=r_moe_ep,
                                    moe_dp=r_moe_dp,
                                    order=draw(st.sampled_from(ORDERS)),
                                    intermediate_padded=padded,
                                    pad_mode="blocked" if pad_mode == "blocked" else "even")
        return Case(spec, trainer, receiver)

    return _case()
