"""The distributed-export check catches planted trainer-side bugs in real ranks, and names them.

Each mutant is the reference distributed exporter with one realistic bug planted (the bugs
public RL exporters have shipped): experts numbered round-robin where Megatron numbers them in
blocks, engine ranks given round-robin experts, the ETP gather run over the dense TP group
(verl, EP 1 and ETP != TP), the first call's gathered tensors cached and re-sent, a parameter
rebound to fresh storage (offload / onload done wrong). Running the suite's own check
(:func:`suites.harness.distributed.run_and_judge`) must fail, locate the damage and name the
pattern. The receiver-side twin of the stale buffer - a loader that defers its copies and
reads a bucket after the sender refilled it - is in ``test_mutations_values.py``.
"""

from __future__ import annotations

import pytest

from ..harness import distributed as dh
from ..harness import judge
from ..harness.cases import DIST_CASES
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


def _case(fragment: str):
    return next(c for c in DIST_CASES if fragment in c.id)


#: Trainer EP 4 (2 local experts), engine EP 4 (2 local experts) of 8: the interleaved
#: numberings of the two sides are different permutations, so each is named on its own.
EP4 = _case("T.tp2ep4etp1pp1te")
#: Dense TP 4, ETP 2, EP 1: the layout where a gather over the dense TP group shows.
TP4_ETP2_EP1 = _case("T.tp4ep1etp2pp1te")
#: ETP 2, EP 2, two versions per format: anything.
ETP2_EP2 = _case("T.tp2ep2etp2pp1te")


class _Planted(ReferenceImplementation):
    """The reference distributed exporter, its gather and send steps open to a planted bug."""

    def gathered(self, spec, model_state):
        from pytest_weightsync.reference_impl.senders.distributed_export import gather_full

        return gather_full(spec, model_state)

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes):
        from pytest_weightsync.reference_impl.senders.distributed_export import engine_streams

        full = self.gathered(spec, model_state)
        return engine_streams(self.placed(full, format, spec, trainer, receiver), format=format,
                              spec=spec, receiver=receiver, delivery=delivery,
                              bucket_bytes=bucket_bytes)

    def placed(self, full, format, spec, trainer, receiver):
        return full


def _permuted(full, holds):
    """``full`` with expert ``g`` holding what ``full`` holds for expert ``holds(g)``."""
    return {layer: tuple(experts[holds(g)] for g in range(len(experts)))
            for layer, experts in full.items()}


class InterleavedExpertNumbering(_Planted):
    """Global expert id = local * EP + ep_rank (round-robin) for what Megatron numbers in
    blocks (ep_rank * local_experts + local)."""

    name = "mutant-interleaved-numbering"

    def placed(self, full, format, spec, trainer, receiver):
        ep, local = trainer.ep, spec.num_experts // trainer.ep
        return _permuted(full, lambda g: (g % ep) * local + g // ep)


class RoundRobinEngineRouting(_Planted):
    """``direct`` payloads give engine EP rank r experts r, r + EP, ... (round-robin), where
    SGLang's FusedMoE holds a block."""

    name = "mutant-round-robin-routing"

    def placed(self, full, format, spec, trainer, receiver):
        if format != "direct":
            return full
        ep, local = receiver.moe_ep, spec.num_experts // receiver.moe_ep
        return _permuted(full, lambda g: (g % local) * ep + g // local)


class DenseTPGather(_Planted):
    """Gathers the ETP shards over the dense tensor-parallel group (verl's legacy
    ``per_tensor_generator`` with EP 1 and ETP != TP)."""

    name = "mutant-dense-tp-gather"

    def gathered(self, spec, model_state):
        from megatron.core import parallel_state as ps

        from pytest_weightsync.reference_impl.senders.distributed_export import gather_full

        return gather_full(spec, model_state, etp=ps.get_tensor_model_parallel_group())


class CachesFirstGather(_Planted):
    """Gathers once and re-sends those tensors on every later update."""

    name = "mutant-stale-cache"

    def gathered(self, spec, model_state):
        if not hasattr(self, "_cache"):
            self._cache = super().gathered(spec, model_state)
        return self._cache


class RebindsAParameter(_Planted):
    """Moves one parameter to fresh storage after exporting (``param.data = ...clone()``, as
    an offload / onload round trip done wrong): the values are right, the optimizer's
    reference is not."""

    name = "mutant-rebinding"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes):
        import torch.distributed as dist

        result = super().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
        if dist.get_rank() == 1:
            param = next(p for n, p in model_state.items() if n.endswith("linear_fc1.weight0"))
            param.data = param.data.clone()
        return result


def _fails(rank_pool, impl, dcase, formats, head: str) -> str:
    """The failure's message after its first line, which must be ``head`` (what was sent where)."""
    dh.require_megatron()
    with pytest.raises(judge.ConformanceError) as info:
        dh.run_and_judge(rank_pool, impl, dcase, formats)
    first, _, rest = str(info.value).partition("\n")
    assert first == head, str(info.value)
    return rest


def test_reference_exporter_passes_the_cases_the_mutants_use(rank_pool):
    dh.require_megatron()
    for dcase in (EP4, TP4_ETP2_EP1):
        assert dh.run_and_judge(rank_pool, _Planted(), dcase, ["direct", "compat"]).checked


#: Expert misplacements: the mutant, its format, which expert engine rank 0's slot for expert 1
#: then holds, the pattern named, and the one it must not be mistaken for.
MISPLACED = {
    "interleaved_trainer_numbering": (lambda: InterleavedExpertNumbering(), "compat", 2,
                                      "interleaved trainer expert numbering",
                                      "round-robin engine"),
    "round_robin_engine_routing": (lambda: RoundRobinEngineRouting(), "direct", 4,
                                   "round-robin engine expert routing", "interleaved trainer"),
}


@pytest.mark.parametrize("mutant", sorted(MISPLACED))
def test_misplaced_experts_are_killed_and_named(rank_pool, mutant):
    make, fmt, held, named, other = MISPLACED[mutant]
    message = _fails(rank_pool, make(), EP4, [fmt],
                     f"{fmt} payload, distributed delivery, trainer rank 0 (sender) -> engine "
                     f"rank 0:")
    assert message.startswith(f"experts misplaced: receiver rank 0's slot for expert 1 holds "
                              f"expert {held}'s values (1 of 2 local experts) - {named}"), message
    assert other not in message.splitlines()[0]
    assert "first at layer=0 expert=1 projection=gate row=0 col=0" in message, message


def test_gather_over_the_dense_tp_group_is_killed_and_named(rank_pool):
    message = _fails(rank_pool, DenseTPGather(), TP4_ETP2_EP1, ["compat"],
                     "compat payload, colocated delivery, trainer rank 0 -> colocated engine "
                     "replica 0 rank 0:")
    assert message.startswith("gathered over the dense tensor-parallel group (size 4) instead "
                              "of the expert tensor-parallel group (size 2): model.layers.0."
                              "mlp.experts.0.gate_proj.weight is (8, 8), expected (4, 8)"), \
        message
    assert "the reference receiver refused the stream: PayloadShapeError" in message


def test_an_exporter_that_caches_its_first_gather_is_killed_as_stale(rank_pool):
    message = _fails(rank_pool, CachesFirstGather(), ETP2_EP2, ["compat", "direct"],
                     "direct payload, colocated delivery, trainer rank 0 -> colocated engine "
                     "replica 0 rank 0:")
    assert message.startswith("stale: it still holds the previous version's values"), message
    assert "first at layer=0 expert=0 projection=" in message, message


def test_an_exporter_that_rebinds_a_parameter_is_killed_as_rebound(rank_pool):
    dh.require_megatron()
    with pytest.raises(judge.ConformanceError) as info:
        dh.run_and_judge(rank_pool, RebindsAParameter(), ETP2_EP2, ["compat"])
    message = str(info.value)
    assert message.startswith(
        "export call for update 1 (compat, colocated delivery) in trainer rank 1 rebound "
        "trainer rank 1's parameter module.module.decoder.layers.0.mlp.experts.linear_fc1."
        "weight0: data_ptr 0x"), message
    assert "param.data reassigned" in message
