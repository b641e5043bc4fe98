"""LoRA refit, driven and judged: adapters synced instead of weights.

The cases (:data:`ADAPTER_CASES`) cross the models the suites use (Qwen3-MoE; Qwen3.5-MoE with
its GDN layers, which carry no LoRA, and its shared expert), ranks 8 to 64 with ``alpha != r``,
``all-linear`` and a subset of targets, with and without expert LoRA, and engine topologies
(TP, MoE-EP). Expected values come from the oracle (:mod:`pytest_weightsync.reference_impl.oracle.adapter_synth`)
and the engine's adapter layout (:mod:`pytest_weightsync.reference_impl.model.adapter_layout`),
never from the sender, loader or merger under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from . import calls, memo


@dataclass(frozen=True)
class AdapterCase:
    """One adapter on one engine topology, exported from one trainer topology."""

    adapter: object
    receiver: object
    trainer: object = None

    @property
    def id(self) -> str:
        r, t = self.receiver, self.trainer
        trained = "" if t is None else f"-T.tp{t.tp}ep{t.ep}etp{t.etp}pp{t.pp}"
        return f"{self.adapter.id}-R.tp{r.tp}ep{r.moe_ep}{trained}"

    @property
    def bridge_expressible(self) -> bool:
        """Whether Megatron-Bridge's LoRA can hold this adapter: one adapter per fused base,
        so q/k/v and gate/up targeted together or not at all."""
        modules = set(self.adapter.modules)
        return all(len(modules & group) in (0, len(group))
                   for group in ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}))


def _cases() -> list:
    from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec
    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, TrainerTopology
    from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe

    q3, q35 = qwen3_moe(num_heads=4, num_kv_heads=2), qwen3_5_moe()
    return [
        AdapterCase(AdapterSpec(q3, 8, 16), ReceiverTopology(tp=1),
                    TrainerTopology(tp=2, ep=2)),
        AdapterCase(AdapterSpec(q3, 16, 24, targets=("q_proj", "v_proj", "down_proj"),
                                experts=False), ReceiverTopology(tp=2)),
        AdapterCase(AdapterSpec(q35, 64, 16), ReceiverTopology(tp=2, moe_ep=2),
                    TrainerTopology(tp=2, ep=2, etp=2, pp=2)),
        AdapterCase(AdapterSpec(q35, 32, 64, experts=False), ReceiverTopology(tp=2),
                    TrainerTopology(tp=1, pp=2)),
        AdapterCase(AdapterSpec(q3, 48, 96, targets=("o_proj", "gate_proj", "up_proj")),
                    ReceiverTopology(tp=4, moe_ep=2), TrainerTopology(tp=2, ep=4)),
    ]


ADAPTER_CASES = _cases()
CASE_PARAMS = [pytest.param(c, id=c.id) for c in ADAPTER_CASES]
#: The cases a Megatron-Bridge trainer can hold (an exporter's input), with buckets of at most
#: :data:`EXPORT_BUCKET` bytes: an adapter of several buckets.
EXPORT_PARAMS = [pytest.param(c, id=c.id) for c in ADAPTER_CASES
                 if c.trainer is not None and c.bridge_expressible]
EXPORT_BUCKET = 2048


class LoraConformanceError(AssertionError):
    """An adapter that did not land, landed elsewhere, or touched the base: located."""


def base_weights(adapter, version: int = 1) -> dict:
    """Checkpoint name -> every base weight an adapter of ``adapter`` may target, at
    ``version`` (routed experts under their per-expert names)."""
    from pytest_weightsync.reference_impl.oracle import model_synth

    spec = adapter.model
    full = model_synth.full_model(spec, version)
    out = dict(full.dense)
    for layer, experts in full.experts["target"].items():
        for e, weights in enumerate(experts):
            for proj in ("gate", "up", "down"):
                out[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = weights[proj]
    return out


def merge_and_check(impl, case: AdapterCase, version: int = 1) -> None:
    """``impl.merge_adapter`` on the oracle's base and adapter equals the oracle's merge, bit
    for bit, every targeted weight; nothing else returned; the inputs unchanged."""
    from pytest_weightsync import compare
    from pytest_weightsync.reference_impl.oracle import adapter_synth

    adapter = case.adapter
    base = base_weights(adapter)
    tensors = adapter_synth.adapter_tensors(adapter, version)
    before = compare.snapshot({**base, **tensors})
    merged = calls.call(impl, "merge_adapter", base, tensors, adapter=adapter)
    expected = adapter_synth.merged_model(adapter, 1, version)
    if not isinstance(merged, dict) or set(merged) != set(expected):
        got = sorted(merged) if isinstance(merged, dict) else type(merged).__name__
        raise LoraConformanceError(f"{impl.name}.merge_adapter returned {str(got)[:200]}; "
                                   f"expected every targeted base weight "
                                   f"({len(expected)}: first {next(iter(expected))!r})")
    for name, tensor in expected.items():
        try:
            compare.assert_bitwise_equal(merged[name], tensor, name=f"merged {name}")
        except compare.ComparisonError as error:
            raise LoraConformanceError(f"{impl.name}: {error} - {merge_pattern(merged[name], name, base, tensors, adapter)}") from None
    compare.assert_unchanged(before, {**base, **tensors})


def merge_pattern(got, name, base, tensors, adapter) -> str:
    """What a wrong merged weight looks like."""
    import torch

    from pytest_weightsync.reference_impl.model.adapter_spec import lora_params

    param = lora_params(adapter)[name]
    w, a, b = base[name], tensors[param.a_name], tensors[param.b_name]
    guesses = {
        "the scaling applied twice": (w.float() + (b.float() @ a.float()) * adapter.scaling ** 2),
        "the scaling never applied": (w.float() + b.float() @ a.float()),
        "B @ A rounded to the base dtype before the add": (
            w.float() + ((b.float() @ a.float()) * adapter.scaling).to(w.dtype).float()),
    }
    for what, value in guesses.items():
        if torch.equal(value.to(w.dtype).view(torch.int16),
                                             got.view(torch.int16)):
            return what
    return "not a merge of this base and adapter"


#: Adapter slots an engine rank holds in the LoRA cases (slot 0 serves the base model).
SLOTS = 4


def engine_state(case: AdapterCase, rank: int, layout: str):
    """``(params, slots)`` of engine rank ``rank``: the base weights at version 1 (the
    whole-model engine parameters) and zeroed adapter buffers of ``layout``."""
    from pytest_weightsync.reference_impl.engine.adapter_receiver import allocate_slots

    params = _fresh(_base_params(case.adapter.model, case.receiver, rank))
    return params, allocate_slots(case.adapter, case.receiver, rank, layout, SLOTS)


def payload(adapter, version: int) -> list:
    """The adapter's tensors at ``version`` as a trainer exports them (Megatron-Bridge names):
    fresh tensors every call (a loader may scale what it is handed in place)."""
    return list(_fresh(_adapter_tensors(adapter, version)).items())


# The oracle's values are computed once per (adapter or model, topology, rank, version) - every
# test of a case and every rank loop asks for the same ones - and handed out as copies, so
# nothing a loader does to its inputs reaches the next test.

@memo.memo(maxsize=32)
def _base_params(model, receiver, rank: int) -> tuple:
    from pytest_weightsync.reference_impl.oracle import model_synth

    return tuple(model_synth.expected_engine_params(model, receiver, rank, 1).items())


@memo.memo(maxsize=32)
def _adapter_tensors(adapter, version: int) -> tuple:
    from pytest_weightsync.reference_impl.oracle import adapter_synth

    return tuple(adapter_synth.adapter_tensors(adapter, version).items())


@memo.memo(maxsize=128)
def _expected_slots(adapter, receiver, rank: int, layout: str, versions: tuple) -> dict:
    """The oracle's buffers (:func:`check_slots` only reads them)."""
    from pytest_weightsync.reference_impl.oracle import adapter_synth

    return adapter_synth.expected_slots(adapter, receiver, rank, layout, SLOTS, dict(versions))


def _fresh(pairs) -> dict:
    """``name -> tensor`` copies of ``pairs`` (a dict or its items); one object aliased under
    two names stays one object."""
    copies: dict = {}
    out = {}
    for name, tensor in (pairs.items() if isinstance(pairs, dict) else pairs):
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        out[name] = copies[id(tensor)]
    return out


def load(impl, case: AdapterCase, rank: int, layout: str, params, slots, items, slot: int):
    calls.call(impl, "load_adapter", params, slots, items, adapter=case.adapter,
               topology=case.receiver, rank=rank, slot=slot, layout=layout)


def check_slots(impl, case: AdapterCase, rank: int, layout: str, slots, versions: dict,
                what: str) -> None:
    """Every buffer of ``slots`` holds what the oracle places there for ``versions``
    (``{slot: version}``; other slots zero), bit for bit; the first difference located."""
    from pytest_weightsync import compare

    expected = _expected_slots(case.adapter, case.receiver, rank, layout,
                               tuple(versions.items()))
    if set(slots) != set(expected):
        raise LoraConformanceError(f"{impl.name}: rank {rank} ({layout}) buffers "
                                   f"{sorted(set(slots) ^ set(expected))[:4]} differ from the "
                                   f"layout's")
    for name, tensor in expected.items():
        try:
            compare.assert_bitwise_equal(slots[name], tensor, name=name, rank=rank)
        except compare.ComparisonError as error:
            raise LoraConformanceError(
                f"{impl.name} ({layout}, {what}): {error} - "
                f"{slot_pattern(case, rank, layout, slots, name, versions)}") from None


def slot_pattern(case, rank, layout, slots, name, versions) -> str:
    """The bug a wrong buffer looks like: scaled twice or never, gate/up stacked the wrong way
    round, a neighbouring expert's slot, a tensor dropped - each tried as a model of the
    buffer, by the oracle; else what it might be."""
    import torch

    from pytest_weightsync.reference_impl.oracle import adapter_synth

    adapter, got = case.adapter, slots[name]
    if name.endswith("scalings"):
        return "the scaling is not alpha / r"

    def same(**twist) -> bool:
        alt = adapter_synth.expected_slots(adapter, case.receiver, rank, layout, SLOTS,
                                           versions, **twist)
        return torch.equal(alt[name].view(torch.int16), got.view(torch.int16))

    def neighbour(buf, piece):
        if not piece.index:
            return piece
        experts = buf.shape[1]
        return piece._replace(index=((piece.index[0] + 1) % experts,))

    def halves(buf, piece):
        if ".gate_up." not in buf.name:
            return piece
        size = buf.shape[2] // 2
        return piece._replace(dst_start=(piece.dst_start + size) % (2 * size))

    models = ((dict(folds=2), "the scaling applied twice (a rebuild from staged tensors folded "
                              "in place)"),
              (dict(folds=0), "the scaling never applied"),
              (dict(place=neighbour), "an expert's LoRA in its neighbour's slot"),
              (dict(place=halves), "gate and up LoRA stacked in the wrong order"))
    for twist, what in models:
        if same(**twist):
            return what
    expected = adapter_synth.expected_slots(adapter, case.receiver, rank, layout, SLOTS, versions)
    wrong = expected[name].view(torch.int16) != got.view(torch.int16)
    if bool((got.view(torch.int16)[wrong] == 0).all()):
        return "a tensor of the adapter never arrived (its last bucket dropped?)"
    return ("not this adapter's values at these places (A and B swapped, A sliced on the wrong "
            "dimension for a row-parallel base, or another version)")


def export_and_check(impl, case: AdapterCase, layout: str = "sglang", version: int = 1) -> None:
    """``impl.export_adapter`` from every trainer rank's Megatron-Bridge shards, for every
    engine rank: the stream (decoded from whatever transport it travels on) loads into the
    reference adapter loader and every buffer holds the oracle's adapter; the trainer shards
    unchanged; no bucket over the limit by more than one tensor."""
    from pytest_weightsync import compare, distributed
    from pytest_weightsync.protocols import as_stream
    from pytest_weightsync.reference_impl.engine.adapter_receiver import load_adapter
    from pytest_weightsync.reference_impl.oracle import adapter_synth
    from pytest_weightsync.reference_impl.trainer import lora_state

    adapter = case.adapter
    tensors = adapter_synth.bridge_adapter_tensors(adapter, version, case.trainer.ep)
    states = lora_state.adapter_states(adapter, case.trainer, tensors)
    kept = [compare.snapshot(state) for state in states]
    source = f"{impl.name}.export_adapter"
    for rank in range(case.receiver.tp):
        result = calls.call(impl, "export_adapter", states, adapter=adapter,
                            trainer=case.trainer, receiver=case.receiver, rank=rank,
                            bucket_bytes=EXPORT_BUCKET)
        for state, before in zip(states, kept):
            compare.assert_unchanged(before, state)
        try:
            stream = as_stream(distributed.decoded_stream(
                result, engine_rank=rank, engine_tp=case.receiver.tp, source=source,
                transports_met=set()), source=source)
        except (TypeError, distributed.DistributedExportError) as error:
            raise LoraConformanceError(f"{source} for engine rank {rank}: {error}") from None
        for index, bucket in enumerate(stream):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            if len(bucket) > 1 and size > EXPORT_BUCKET:
                raise LoraConformanceError(f"{source} for engine rank {rank}: bucket {index} "
                                           f"holds {size} bytes over the {EXPORT_BUCKET} limit")
        params, slots = engine_state(case, rank, layout)
        try:
            load_adapter(params, slots, [pair for bucket in stream for pair in bucket],
                         adapter=adapter, topology=case.receiver, rank=rank, slot=1,
                         layout=layout)
        except Exception as error:  # noqa: BLE001 - the reference's refusal names it
            raise LoraConformanceError(
                f"{source} for engine rank {rank}: the reference adapter loader refused the "
                f"exported adapter: {error}{export_hint(error)}") from None
        expected = adapter_synth.expected_slots(adapter, case.receiver, rank, layout, SLOTS,
                                                {1: version}, tensors={version: tensors})
        for name, tensor in expected.items():
            try:
                compare.assert_bitwise_equal(slots[name], tensor, name=name, rank=rank)
            except compare.ComparisonError as error:
                raise LoraConformanceError(f"{source} ({layout}): {error} - not the trainer's "
                                           f"adapter (A sharded on the wrong dimension, A and B "
                                           f"swapped, an expert group's adapter under another "
                                           f"expert's name, or gate/up split wrongly)") from None


def export_hint(error) -> str:
    text = str(error)
    if "3-D expert layout" in text:
        return " - 3-D expert LoRA sent where the flat per-expert layout is expected (SkyRL#1852)"
    if "lacks" in text:
        return " - a tensor never sent (the adapter's last bucket dropped?)"
    return ""
