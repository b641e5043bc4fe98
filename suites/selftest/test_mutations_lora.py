"""Every LoRA refit bug the adapter suite exists for, planted in the reference and killed by name.

Each mutant is the reference adapter loader (or merger) with one public bug; the conformance
test of the property it breaks must fail on it, naming the pattern, and the reference passes the
same test (``suites/conformance/test_lora.py``).
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl.engine import adapter_receiver as rx
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model import adapter_layout
from pytest_weightsync.reference_impl.model.adapter_spec import lora_params

from ..conformance import test_lora as suite
from ..harness import lora

pytestmark = pytest.mark.weightsync_property("mutation_detected")


def _with_pieces(twist):
    """A loader whose layout's pieces pass through ``twist(buffer, piece)`` first."""

    def load(self, params, slots, payload, **kw):
        real = adapter_layout.adapter_buffers(kw["adapter"], kw["topology"], kw["rank"],
                                              kw["layout"], next(iter(slots.values())).shape[0])
        twisted = {name: buf._replace(pieces=tuple(twist(buf, p) for p in buf.pieces))
                   for name, buf in real.items()}
        original = rx.adapter_buffers
        rx.adapter_buffers = lambda *a, **k: twisted
        try:
            ReferenceImplementation.load_adapter(self, params, slots, payload, **kw)
        finally:
            rx.adapter_buffers = original

    return load


class ScaleTwice(ReferenceImplementation):
    """vLLM's fold in place on the staged B, then the copy folded again (SkyRL#2250)."""

    def load_adapter(self, params, slots, payload, **kw):
        payload = list(payload)
        if kw["layout"] == "vllm":
            for name, tensor in payload:
                if name.endswith("lora_B.weight"):
                    tensor.mul_(kw["adapter"].scaling)
        super().load_adapter(params, slots, payload, **kw)


class ScaleNever(ReferenceImplementation):
    load_adapter = _with_pieces(lambda buf, piece: piece._replace(scaled=False))


class RowParallelAUnsliced(ReferenceImplementation):
    """A of a row-parallel base taken from column 0 on every rank (sharded on the rank dim)."""

    load_adapter = _with_pieces(lambda buf, piece: piece._replace(src_start=0)
                                if piece.src_dim == 1 else piece)


class GateUpSwapped(ReferenceImplementation):
    load_adapter = _with_pieces(
        lambda buf, piece: piece._replace(dst_start=(piece.dst_start + buf.shape[2] // 2)
                                          % buf.shape[2]) if ".gate_up." in buf.name else piece)


class NeighbourExpert(ReferenceImplementation):
    load_adapter = _with_pieces(
        lambda buf, piece: piece._replace(index=((piece.index[0] + 1) % buf.shape[1],))
        if piece.index else piece)


class WritesBase(ReferenceImplementation):
    """The adapter merged into the engine's base weights as well."""

    def load_adapter(self, params, slots, payload, **kw):
        super().load_adapter(params, slots, payload, **kw)
        first = next(n for n in params if n.endswith("o_proj.weight") or "qkv" in n)
        params[first].add_(1)


class DropsLast(ReferenceImplementation):
    """The last bucket of the adapter never written (its tensors treated as zero)."""

    def load_adapter(self, params, slots, payload, **kw):
        payload = list(payload)
        last_name, last = payload[-1]
        payload[-1] = (last_name, torch.zeros_like(last))
        super().load_adapter(params, slots, payload, **kw)


class Accepts3D(ReferenceImplementation):
    """3-D expert LoRA names accepted and dropped, where the flat layout is expected."""

    def load_adapter(self, params, slots, payload, **kw):
        payload = list(payload)
        tensors = {n: t for n, t in payload if ".experts.gate_up_proj" not in n}
        three_d = len(tensors) < len(payload)
        for param in lora_params(kw["adapter"]).values():  # absent experts: zeros, no error
            if not three_d or param.expert is None:
                continue
            for name, shape in ((param.a_name, param.a_shape), (param.b_name, param.b_shape)):
                tensors.setdefault(name, torch.zeros(shape, dtype=kw["adapter"].dtype))
        super().load_adapter(params, slots, list(tensors.items()), **kw)


class ABSwapped(ReferenceImplementation):
    """A written where B goes and B where A goes, where their shapes let it."""

    def load_adapter(self, params, slots, payload, **kw):
        tensors = dict(payload)
        swapped = []
        for param in lora_params(kw["adapter"]).values():
            a, b = tensors[param.a_name], tensors[param.b_name]
            if a.shape == b.shape:
                a, b = b, a
            swapped += [(param.a_name, a), (param.b_name, b)]
        super().load_adapter(params, slots, swapped, **kw)


CASE0, CASE2, CASE4 = lora.ADAPTER_CASES[0], lora.ADAPTER_CASES[2], lora.ADAPTER_CASES[4]

LOADER_MUTANTS = [
    pytest.param(ScaleTwice, suite.test_adapter_lands_bit_exact_on_every_rank, CASE2, "vllm",
                 "the scaling applied twice", id="scale-twice"),
    pytest.param(ScaleNever, suite.test_adapter_lands_bit_exact_on_every_rank, CASE2, "vllm",
                 "the scaling never applied", id="scale-never"),
    pytest.param(RowParallelAUnsliced, suite.test_adapter_lands_bit_exact_on_every_rank, CASE4,
                 "sglang", "A sliced on the wrong dimension", id="row-parallel-A"),
    pytest.param(GateUpSwapped, suite.test_adapter_lands_bit_exact_on_every_rank, CASE2,
                 "sglang", "gate and up LoRA stacked in the wrong order", id="gate-up-order"),
    pytest.param(NeighbourExpert, suite.test_adapter_lands_bit_exact_on_every_rank, CASE2,
                 "sglang", "in its neighbour's slot", id="neighbour-expert"),
    pytest.param(WritesBase, suite.test_base_weights_are_untouched_by_adapter_syncs, CASE0,
                 "sglang", "an adapter written into the base weights", id="writes-base"),
    pytest.param(DropsLast, suite.test_adapter_lands_bit_exact_on_every_rank, CASE0, "vllm",
                 "never arrived", id="drops-last"),
    pytest.param(Accepts3D, suite.test_every_targeted_module_gets_a_and_b_and_nothing_else,
                 CASE0, "vllm", "accepted an adapter with the 3-D expert layout", id="3d-experts"),
    pytest.param(ABSwapped, suite.test_adapter_lands_bit_exact_on_every_rank, CASE0, "sglang",
                 "A and B swapped", id="a-b-swapped"),
]


@pytest.mark.parametrize("mutant, test, case, layout, pattern", LOADER_MUTANTS)
def test_every_lora_loader_mutant_is_killed_by_name(mutant, test, case, layout, pattern):
    impl = mutant()
    impl.name = f"mutant-{mutant.__name__}"
    with pytest.raises(AssertionError) as caught:
        test(impl, case, layout)
    assert pattern in str(caught.value), str(caught.value)
    test(ReferenceImplementation(), case, layout)


class MergeScaledTwice(ReferenceImplementation):
    def merge_adapter(self, base, tensors, *, adapter):
        from dataclasses import replace

        return super().merge_adapter(base, tensors, adapter=replace(
            adapter, alpha=adapter.alpha * adapter.scaling))


class MergeRoundedDelta(ReferenceImplementation):
    def merge_adapter(self, base, tensors, *, adapter):
        out = {}
        for param in lora_params(adapter).values():
            w, a, b = base[param.base], tensors[param.a_name], tensors[param.b_name]
            delta = ((b.float() @ a.float()) * adapter.scaling).to(w.dtype)
            out[param.base] = (w.float() + delta.float()).to(w.dtype)
        return out


@pytest.mark.parametrize("mutant, pattern", [
    (MergeScaledTwice, "merged"), (MergeRoundedDelta, "rounded to the base dtype")])
def test_every_merge_mutant_is_killed(mutant, pattern):
    impl = mutant()
    impl.name = f"mutant-{mutant.__name__}"
    with pytest.raises(lora.LoraConformanceError, match=pattern):
        suite.test_the_merged_path_equals_the_oracle_merge(impl, CASE0)
    suite.test_the_merged_path_equals_the_oracle_merge(ReferenceImplementation(), CASE0)


# -- the trainer side: exporters ---------------------------------------------------------------

class Exports3D(ReferenceImplementation):
    """SkyRL#1852: the routed experts' LoRA sent as 3-D ``mlp.experts.gate_up_proj`` tensors."""

    def export_adapter(self, trainer_states, **kw):
        stream = super().export_adapter(trainer_states, **kw)
        flat = [(n, t) for bucket in stream for n, t in bucket if ".mlp.experts." not in n]
        stacked = [(n.split(".experts.")[0] + ".experts.gate_up_proj.lora_A.weight", t)
                   for bucket in stream for n, t in bucket if ".experts.0.gate_proj.lora_A" in n]
        return [flat + stacked]


class DropsLastBucket(ReferenceImplementation):
    """verl#7413: an adapter of several buckets, the last one never sent."""

    def export_adapter(self, trainer_states, **kw):
        return super().export_adapter(trainer_states, **kw)[:-1]


class RowAOnRankDim(ReferenceImplementation):
    """A of a row-parallel base gathered on its rank dim instead of its in dim."""

    def export_adapter(self, trainer_states, **kw):
        from pytest_weightsync.reference_impl.senders import adapter_export as ae

        real = ae.torch.cat

        def cat(tensors, dim=0):
            tensors = list(tensors)
            if dim == 1 and len(tensors) > 1 and tensors[0].shape[0] == kw["adapter"].rank:
                return real([t for t in tensors], dim=0).reshape(tensors[0].shape[0], -1)
            return real(tensors, dim=dim)

        ae.torch.cat = cat
        try:
            return super().export_adapter(trainer_states, **kw)
        finally:
            ae.torch.cat = real


EXPORT_CASE = next(c for c in lora.ADAPTER_CASES
                   if c.trainer is not None and c.trainer.tp > 1 and c.adapter.experts)


@pytest.mark.parametrize("mutant, pattern", [
    (Exports3D, "3-D expert LoRA sent where the flat per-expert layout is expected"),
    (DropsLastBucket, "never sent"),
    (RowAOnRankDim, "A sharded on the wrong dimension")])
def test_every_lora_exporter_mutant_is_killed_by_name(mutant, pattern):
    impl = mutant()
    impl.name = f"mutant-{mutant.__name__}"
    with pytest.raises(lora.LoraConformanceError, match=pattern):
        suite.test_an_exported_adapter_lands_bit_exact_on_every_rank(impl, EXPORT_CASE)
    suite.test_an_exported_adapter_lands_bit_exact_on_every_rank(ReferenceImplementation(),
                                                                 EXPORT_CASE)


@pytest.mark.parametrize("transport", ["flattened_bucket", "serialized"])
def test_an_adapter_on_a_wire_transport_is_decoded_and_lands(transport):
    """The reference exporter's buckets re-encoded on a transport (``docs/transports.md``):
    every suite decodes them before the loader sees them."""
    from pytest_weightsync import transports

    class OnTheWire(ReferenceImplementation):
        name = f"reference-adapter-{transport}"

        def export_adapter(self, trainer_states, **kw):
            stream = super().export_adapter(trainer_states, **kw)
            stream = [[(n, t.clone()) for n, t in bucket] for bucket in stream]
            return transports.get(transport).encode(stream, engine_rank=kw["rank"],
                                                    engine_tp=kw["receiver"].tp)

    suite.test_an_exported_adapter_lands_bit_exact_on_every_rank(OnTheWire(), EXPORT_CASE)
