"""vLLM's uneven expert parallelism as a harness engine: placement, refusals, claims, mutants.

vLLM places E experts over EP ranks with ``determine_expert_map`` (linear): the first
``E % EP`` ranks hold one expert more. SGLang refuses ``E % EP != 0``, so the harness's engines
express vLLM's placement explicitly, ``ReceiverTopology(expert_placement="linear_uneven")``,
and the matrix carries two such engines (``cases.UNEVEN_EP_CASES``). Here:

- the harness's placement (``layout.receiver_shard`` and every rank's parameter shapes) is
  ``vllm_layout``'s model of ``determine_expert_map`` (which ``test_vllm_layouts.py`` holds to
  vLLM's own source), for every expert count and EP size up to 12 and 8, and
  ``vllm_topology`` / ``receiver_topology`` map the two engines onto each other;
- each placement refuses, with the project's ``TopologyError``, what its engine cannot build;
- the reference claims the uneven cases; the stock SGLang rows and a default ``Capabilities``
  do not (skipped as not claimed, with the reason), never failed;
- a loader that gives the remainder to the last rank, or computes EP rank e's first expert as
  ``e * E // EP``, fails the uneven cases with the wrong element located (layer, expert,
  receiver rank) and the pattern named ("uneven EP placement miscounted"), while its rule is
  the right one on every even case of the matrix (and the loader passes the even EP
  anchors).
"""

from __future__ import annotations

import dataclasses

import pytest

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.backends import sglang_models
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.impl import ReferenceImplementation, is_model_spec
from pytest_weightsync.reference_impl.model import vllm_layout as v
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    TopologyError,
    receiver_param_shapes,
    receiver_shard,
)
from pytest_weightsync.vocabulary import FORMATS

from ..conformance import test_loader as loader_suite
from ..harness import cases, claims

pytestmark = pytest.mark.weightsync_property("receiver_layout")

UNEVEN = [pytest.param(case, id=case.id) for case in cases.UNEVEN_EP_CASES]
EVEN = [case for case in cases.CASES if case not in cases.UNEVEN_EP_CASES]


# --------------------------------------------------------------------------------------------
# The placement is vLLM's
# --------------------------------------------------------------------------------------------


def test_the_harness_placement_is_vllms_expert_map():
    """Every (E, EP) with E >= EP: the harness engine ``receiver_topology`` gives for vLLM's
    EP engine holds, on every rank, the experts and parameter shapes vLLM's model says."""
    compared = uneven = 0
    for experts in range(1, 13):
        spec = MoESpec(num_layers=1, num_experts=experts, hidden=4, intermediate=4)
        for ep in range(2, 9):
            if ep > experts:
                continue
            engine = v.VllmTopology(tp=ep, expert_parallel=True)
            receiver = v.receiver_topology(spec, engine)
            even = experts % ep == 0
            assert receiver.expert_placement == ("even" if even else "linear_uneven")
            assert v.vllm_topology(receiver) == engine
            explicit = ReceiverTopology(tp=ep, moe_ep=ep, expert_placement="linear_uneven")
            for rank in range(ep):
                want = v.expert_shard(spec, engine, rank)
                for topo in (receiver, explicit):
                    got = receiver_shard(spec, topo, rank)
                    assert (got.experts, got.moe_ep_rank, got.rows) == (
                        want.experts, want.moe_ep_rank, want.rows), (experts, ep, rank, topo)
                    assert list(receiver_param_shapes(spec, topo, rank).values()) == list(
                        v.expert_param_shapes(spec, engine, rank).values())
                compared += 1
            uneven += not even
    assert compared > 200 and uneven > 30  # the loops ran over uneven maps too


@pytest.mark.parametrize("case", UNEVEN)
def test_each_uneven_matrix_case_is_a_vllm_ep_engine_with_unequal_ranks(case):
    engine = v.vllm_topology(case.receiver)
    assert engine == v.VllmTopology(tp=case.receiver.tp, expert_parallel=True)
    assert v.receiver_topology(case.spec, engine) == case.receiver
    counts = [len(receiver_shard(case.spec, case.receiver, r).experts)
              for r in range(case.receiver.world_size)]
    assert sum(counts) == case.spec.num_experts
    assert max(counts) - min(counts) == 1 and counts == sorted(counts, reverse=True)
    assert case.id.endswith("-linear_uneven")
    assert case in cases.CASES  # the loader and exporter matrix runs it


# --------------------------------------------------------------------------------------------
# Refusals: the project's error, naming the constraint
# --------------------------------------------------------------------------------------------

FIVE = MoESpec(num_layers=1, num_experts=5, hidden=4, intermediate=4)
REFUSED = {
    "SGLang's even placement, 5 over 2": (
        lambda: receiver_shard(FIVE, ReceiverTopology(tp=2, moe_ep=2), 0), "divisible"),
    "MoE-TP x EP mix": (
        lambda: ReceiverTopology(tp=4, moe_ep=2, expert_placement="linear_uneven"), "moe_tp 1"),
    "MoE-DP": (
        lambda: ReceiverTopology(tp=4, moe_ep=2, moe_dp=2, expert_placement="linear_uneven"),
        "moe_dp 1"),
    "up/gate order": (
        lambda: ReceiverTopology(tp=2, moe_ep=2, order="up_gate",
                                 expert_placement="linear_uneven"), "gate_up"),
    "padded": (
        lambda: ReceiverTopology(tp=2, moe_ep=2, intermediate_padded=8,
                                 expert_placement="linear_uneven"), "unpadded"),
    "EPLB": (
        lambda: ReceiverTopology(tp=2, moe_ep=2, redundant_experts=1,
                                 expert_placement="linear_uneven"), "no EPLB"),
    "more ranks than experts": (
        lambda: receiver_shard(MoESpec(1, 3, 4, 4), ReceiverTopology(
            tp=4, moe_ep=4, expert_placement="linear_uneven"), 0), "at least one expert"),
    "unknown placement": (
        lambda: ReceiverTopology(tp=2, moe_ep=2, expert_placement="round_robin"),
        "must be one of"),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_each_placement_refuses_what_its_engine_cannot_build(what):
    build, words = REFUSED[what]
    with pytest.raises(TopologyError, match=words) as info:
        build()
    assert isinstance(info.value, WeightSyncError)


# --------------------------------------------------------------------------------------------
# Claims: the reference runs the uneven cases, SGLang rows and default claims do not
# --------------------------------------------------------------------------------------------


class _Default:
    """A row that claims what ``Capabilities()`` claims (an SGLang loader written from the
    docs, like the example package's)."""

    name = "default-claims"
    capabilities = Capabilities()


@pytest.mark.parametrize("case", UNEVEN)
def test_the_reference_claims_the_uneven_cases_and_sglang_rows_do_not(case):
    for role in ("loader", "exporter"):
        for fmt in FORMATS:
            assert claims.unclaimed(ReferenceImplementation(), role, case, fmt) is None
        reason = claims.unclaimed(_Default(), role, case)
        assert reason is not None and "'linear_uneven'" in reason, reason
    for row in (sglang_models.Qwen3MoeLoader, sglang_models.Qwen35MoeLoader):
        reason = claims.unclaimed(row, "loader", case)
        assert reason is not None and "expert placements ['even']" in reason, reason
        # and SGLang's own refusal says why, for what reaches the row without the claim check
        assert "num_experts % ep_size" in sglang_models.sglang_refusal(case.spec, case.receiver)
    with pytest.raises(ValueError, match="expert_placements"):
        Capabilities(expert_placements={"round_robin"})


# --------------------------------------------------------------------------------------------
# Loaders that misplace an uneven EP map: killed on the uneven cases, located; even cases pass
# --------------------------------------------------------------------------------------------


def _remainder_on_last(num: int, ep: int, ep_rank: int, held: range) -> range:
    """``E // EP`` experts per rank, the whole remainder on the last one."""
    base = num // ep
    return range(ep_rank * base, (ep_rank + 1) * base + (num % ep if ep_rank == ep - 1 else 0))


def _offset_as_if_even(num: int, ep: int, ep_rank: int, held: range) -> range:
    """The right number of experts (the parameter's first dimension), from ``e * E // EP``."""
    start = ep_rank * num // ep
    return range(start, start + len(held))


class _MisplacingReceiver(ReferenceReceiver):
    """The reference receiver with its EP rank's experts computed by ``rule``."""

    rule = staticmethod(_remainder_on_last)

    def __init__(self, spec, topo, rank, **kwargs):
        super().__init__(spec, topo, rank, **kwargs)
        held = self.shard.experts
        self.shard = dataclasses.replace(
            self.shard, experts=self.rule(spec.num_experts, topo.moe_ep, self.shard.moe_ep_rank,
                                          held))


class _MisplacingLoader(ReferenceImplementation):
    def __init__(self, name: str, rule):
        super().__init__()
        self.name = name
        self.receiver_cls = type(f"_{name}", (_MisplacingReceiver,), {"rule": staticmethod(rule)})

    def _receiver(self, params, spec, topology, rank, targets=None):
        if is_model_spec(spec) or not topology.default_engine:
            return super()._receiver(params, spec, topology, rank, targets)
        return self.receiver_cls(spec, topology, rank, params=params)


MUTANTS = {"remainder_on_last_rank": _remainder_on_last,
           "offset_as_if_even": _offset_as_if_even}
#: The bug pattern each mutant must be named by (``diagnosis.uneven_ep_miscount``).
PATTERNS = {"remainder_on_last_rank": "the remainder given to the last EP rank",
            "offset_as_if_even": "first expert computed as e * E // EP"}
#: Where each mutant's first wrong element is, per uneven case: (expert, receiver rank).
#: Remainder on the last rank: rank 0 (which holds one more) never writes its last slot.
#: Offset ``e * E // EP``: rank 1 starts one expert early (expert e's slot holds e - 1).
FIRST_WRONG = {
    ("remainder_on_last_rank", 0): (2, 0), ("remainder_on_last_rank", 1): (1, 0),
    ("offset_as_if_even", 0): (3, 1), ("offset_as_if_even", 1): (2, 1),
}
#: ``direct`` copies each rank's whole tensors (the sender placed them): nothing to misplace.
PLACED_BY_LOADER = [f for f in FORMATS if f != "direct"]


@pytest.mark.parametrize("fmt", PLACED_BY_LOADER)
@pytest.mark.parametrize("which", range(len(cases.UNEVEN_EP_CASES)))
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_misplacing_loader_fails_the_uneven_case_located(mutant, which, fmt):
    case = cases.UNEVEN_EP_CASES[which]
    impl = _MisplacingLoader(mutant, MUTANTS[mutant])
    with pytest.raises(AssertionError) as info:
        loader_suite.test_loader_lands_bit_exact_on_every_rank(impl, case, fmt)
    message = str(info.value)
    expert, rank = FIRST_WRONG[(mutant, which)]
    for word in ("layer=0 ", f"expert={expert} ", f"receiver_rank={rank}",
                 "uneven EP placement miscounted", PATTERNS[mutant]):
        assert word in message, f"{mutant} killed, but not located ({word!r}):\n{message}"


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_misplacing_loader_passes_every_even_case(mutant):
    """The control: on every even matrix case each mutant's rule gives every EP rank exactly
    its experts, and the mutant loader run through the loader suite on the even EP anchors
    passes - so every kill above is the uneven placement's, and the mutants are sound."""
    rule = MUTANTS[mutant]
    assert len(EVEN) >= 25
    for case in EVEN:
        for rank in range(case.receiver.world_size):
            shard = receiver_shard(case.spec, case.receiver, rank)
            assert rule(case.spec.num_experts, case.receiver.moe_ep, shard.moe_ep_rank,
                        shard.experts) == shard.experts, (case.id, rank)
    impl = _MisplacingLoader(mutant, rule)
    anchors = [case for case in cases.ANCHORS if case.receiver.moe_ep > 1]
    assert len(anchors) >= 3
    for case in anchors:
        loader_suite.test_loader_lands_bit_exact_on_every_rank(impl, case, "compat")
