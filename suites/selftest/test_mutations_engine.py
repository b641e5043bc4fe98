"""Planted engine bugs are killed by the engine_layout conformance test - named and located.

Each mutant is the reference loader with one realistic bug of the kind the 2026 reports
describe, run through the unchanged conformance test
(``test_loader.test_loader_engine_layout_holds_after_every_update``):

- ``post_load_rerun``: the TRT-LLM block layout re-applied after every bucket, over rows that
  already hold it (vllm#42821, miles#1926: a transform re-run on transformed weights);
- ``post_load_once``: the layout applied after the first update only - later updates write the
  checkpoint rows into the transformed buffer and leave them raw (vllm#56570, sglang#25190);
- ``first_copy_only``: of a redundant (EPLB) expert only the first physical slot written;
- ``first_copy_of_the_engine_only``: the same across ranks - a rank that holds only a later
  copy of an expert never writes it;
- ``stale_placement``: every update written by the placement of the first one, after the
  engine rebalanced (vllm#55228, prime-rl#3583);
- ``neighbour_scale``: FP8 block scales paired with the block next to theirs
  (ISEEKYAN/Megatron-LM#191: scales paired with the wrong weights);
- ``stale_scales``: new FP8 weights beside the scales of the first update - the sender's
  scales ignored after it, or the loader re-quantizing with the scales it computed first
  (verl#7519: derived scales not rebuilt).

Killed means: a :class:`ConformanceError` whose first line names the bug and whose message
locates the first wrong element (layer, expert, projection, row, col).
"""

from __future__ import annotations

import pytest

from ..conformance import test_loader as suite
from ..harness import cases
from ..harness.judge import ConformanceError
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.engine.engine_receivers import (
    PostLoadReceiver,
    RedundantExpertReceiver,
)
from pytest_weightsync.reference_impl.engine.fp8_receiver import Fp8BlockReceiver
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

pytestmark = pytest.mark.weightsync_property("mutation_detected")

TRTLLM = next(c for c in cases.ENGINE_CASES if c.receiver.engine_layout == "trtllm_block")
#: The EPLB case with two copies of one expert on one rank and MoE-TP 2.
EPLB = next(c for c in cases.ENGINE_CASES if c.receiver.placement is not None)
#: SGLang's trivial EPLB map over EP 2: the redundant copies live on the other rank.
EPLB_TRIVIAL = next(c for c in cases.ENGINE_CASES
                    if c.receiver.eplb and c.receiver.placement is None)
LOCATED = ("layer=", "expert=", "projection=", "row=", "col=")


class _RerunReceiver(PostLoadReceiver):
    def load(self, payload, load_format=None):
        plan = super().load(payload, load_format)
        for name, param in self._param_kinds():  # "post-process" after every bucket
            tensor = self.params[name]
            if engine_layout.held_layout(tensor) is not None:
                delattr(tensor, engine_layout.MARK)
            engine_layout.apply_post_load(tensor, param, self.topo.engine_layout)
        return plan


class _OnceReceiver(PostLoadReceiver):
    def begin_update(self) -> None:
        # no restore: the loader writes into the transformed buffer, and since the marks of
        # the first update are still there, end_update finds it "already post-processed"
        ReferenceReceiver.begin_update(self)


class _FirstCopyReceiver(RedundantExpertReceiver):
    def _write_w13(self, plan, layer, expert, projection, full) -> None:
        for slot in self.shard.slots_of(layer, expert)[:1]:
            ReferenceReceiver._write_w13(self, plan, layer, slot, projection, full)

    def _write_w2(self, plan, layer, expert, full) -> None:
        for slot in self.shard.slots_of(layer, expert)[:1]:
            ReferenceReceiver._write_w2(self, plan, layer, slot, full)


class _FirstGlobalCopyReceiver(RedundantExpertReceiver):
    """Writes a logical expert into its first physical slot of the whole engine only: a rank
    that holds only later copies never writes them."""

    def _firsts(self, layer, expert):
        row = self.topo.physical_to_logical(self.spec)[layer]
        first = next(p for p, logical in enumerate(row) if logical == expert)
        return [s for s in self.shard.slots_of(layer, expert) if self.shard.experts[s] == first]

    def _write_w13(self, plan, layer, expert, projection, full) -> None:
        for slot in self._firsts(layer, expert):
            ReferenceReceiver._write_w13(self, plan, layer, slot, projection, full)

    def _write_w2(self, plan, layer, expert, full) -> None:
        for slot in self._firsts(layer, expert):
            ReferenceReceiver._write_w2(self, plan, layer, slot, full)


class _Mutant(ReferenceImplementation):
    def __init__(self, name, receiver_cls=None, stale=False):
        super().__init__()
        self.name = name
        self.receiver_cls = receiver_cls
        self.stale = stale
        self.first_topology: dict = {}

    def _receiver(self, params, spec, topology, rank, targets=None):
        if self.stale:  # the placement the first update saw, whatever the call says
            key = id(next(t for n, t in params.items() if n.endswith("w13_weight")))
            topology = self.first_topology.setdefault(key, topology)
        if self.receiver_cls is None:
            return super()._receiver(params, spec, topology, rank)
        return self.receiver_cls(spec, topology, rank, params=params)


FP8_CASE = cases.FP8_CASES[0]


class _NeighbourScaleReceiver(Fp8BlockReceiver):
    def _split(self, payload, load_format):
        weights, scales = super()._split(payload, load_format)
        return weights, [(n, s.roll(1, dims=-2)) for n, s in scales]  # block i gets i-1's


class _StaleScaleReceiver(Fp8BlockReceiver):
    first: dict = {}

    def _split(self, payload, load_format):
        weights, scales = super()._split(payload, load_format)
        key = id(self.params[next(iter(self.params))])
        kept = type(self).first.setdefault(key, {})
        for name, tensor in scales:
            kept.setdefault(name, tensor.clone())
        return weights, [(n, kept[n].clone()) for n, _ in scales]


MUTANTS = {
    "post_load_rerun": (TRTLLM, lambda: _Mutant("post_load_rerun", _RerunReceiver),
                        "post-load layout applied twice"),
    "post_load_once": (TRTLLM, lambda: _Mutant("post_load_once", _OnceReceiver),
                       "checkpoint layout in a trtllm_block engine"),
    "first_copy_only": (EPLB, lambda: _Mutant("first_copy_only", _FirstCopyReceiver),
                        "only the first physical copy written"),
    "stale_placement": (EPLB, lambda: _Mutant("stale_placement", stale=True),
                        "written by a stale placement"),
    "first_copy_of_the_engine_only": (
        EPLB_TRIVIAL, lambda: _Mutant("first_copy_of_the_engine_only", _FirstGlobalCopyReceiver),
        "only the first physical copy written"),
}
FP8_MUTANTS = {
    "neighbour_scale": (lambda: _Mutant("neighbour_scale", _NeighbourScaleReceiver),
                        "scale of the neighbouring block"),
    "stale_scales": (lambda: _Mutant("stale_scales", _StaleScaleReceiver),
                     "stale block scales"),
}


@pytest.mark.parametrize("payload_format", ["compat", "hf_fused"])
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_engine_mutant_is_killed_named_and_located(mutant, payload_format):
    case, make, named = MUTANTS[mutant]
    with pytest.raises(ConformanceError) as caught:
        suite.test_loader_engine_layout_holds_after_every_update(make(), case, payload_format)
    message = str(caught.value)
    assert message.splitlines()[0].startswith(named), message[:600]
    assert all(word in message for word in LOCATED), message[:600]


@pytest.mark.parametrize("quantizer, payload_format", [("sender", "compat"),
                                                       ("sender", "direct"),
                                                       ("loader", "compat")])
@pytest.mark.parametrize("mutant", sorted(FP8_MUTANTS))
def test_fp8_mutant_is_killed_named_and_located(mutant, quantizer, payload_format):
    make, named = FP8_MUTANTS[mutant]
    _StaleScaleReceiver.first = {}
    with pytest.raises(ConformanceError) as caught:
        suite.test_loader_fp8_block_weights_and_scales_after_every_update(
            make(), FP8_CASE, quantizer, payload_format)
    message = str(caught.value)
    assert message.splitlines()[0].startswith(named), message[:600]
    assert all(word in message for word in ("layer=", "expert=", "projection=")), message[:600]
    if quantizer == "sender":  # bit-exact: the first wrong scale is named by its block
        assert "block=(" in message, message[:600]


def test_reference_passes_the_same_cases():
    """The check the mutants fail is passed by the unplanted reference (same cases, formats)."""
    for case in (TRTLLM, EPLB):
        for fmt in ("compat", "hf_fused"):
            suite.test_loader_engine_layout_holds_after_every_update(
                ReferenceImplementation(), case, fmt)
    for quantizer, fmt in (("sender", "compat"), ("sender", "direct"), ("loader", "compat")):
        suite.test_loader_fp8_block_weights_and_scales_after_every_update(
            ReferenceImplementation(), FP8_CASE, quantizer, fmt)
