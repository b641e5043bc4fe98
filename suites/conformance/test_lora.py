"""LoRA refit: adapters synced instead of weights, held to the oracle.

Each test runs once per registered implementation with the role it needs and states one property
(judged in ``suites/harness/lora.py``; the layouts and their sources in ``docs/lora.md``), on the
adapter cases of ``harness.lora.ADAPTER_CASES`` (Qwen3-MoE and Qwen3.5-MoE, ranks 8 to 64 with
``alpha != r``, all-linear and a subset, with and without expert LoRA, TP and MoE-EP engines) and
each layout the loader claims (``Capabilities.lora``):

- ``lora_bit_exact``: every A and B lands in the engine's buffers bit for bit, on every rank,
  in its slot - loaded by the loader under test, or exported by the exporter under test from
  every trainer rank's Megatron-Bridge shards (TP, EP, ETP, PP; several buckets) and loaded by
  the reference;
- ``lora_coverage``: every targeted module gets A and B, nothing else is written; an adapter the
  engine cannot load as configured (a missing B, a wrong dtype, another rank, the 3-D expert
  layout) is refused before anything is written;
- ``lora_scale_once``: ``alpha / r`` applied exactly once - after an eviction and a rebuild from
  the same staged tensors too, and after several syncs; the staged tensors left as they were;
- ``base_untouched``: the base weights bit-identical, at their addresses, after any number of
  adapter syncs;
- ``lora_versions``: a new version replaces the old one in its slot, never a mix (a refused
  load leaves the old one); several adapters coexist;
- ``lora_merged`` (``merge_adapter``): the merged path equals the oracle's merge, located.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import LORA_LAYOUTS

from ..harness import claims, lora

LAYOUTS = list(LORA_LAYOUTS)


def _claimed(impl, layout):
    if layout not in impl.capabilities.lora:
        claims.skip_unclaimed(f"does not claim the {layout} adapter layout (claims "
                              f"{sorted(impl.capabilities.lora)})")


def _ranks(case):
    return range(case.receiver.tp)


@pytest.mark.weightsync_property("lora_bit_exact")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", lora.CASE_PARAMS)
def test_adapter_lands_bit_exact_on_every_rank(weightsync_adapter_loader, case, layout):
    impl = weightsync_adapter_loader
    _claimed(impl, layout)
    items = lora.payload(case.adapter, 1)
    for rank in _ranks(case):
        params, slots = lora.engine_state(case, rank, layout)
        lora.load(impl, case, rank, layout, params, slots, items, slot=1)
        lora.check_slots(impl, case, rank, layout, slots, {1: 1}, "one adapter in slot 1")


BAD_PAYLOADS = {
    "missing B": lambda items: [(n, t) for n, t in items if not n.endswith("lora_B.weight")][:1]
    + [(n, t) for n, t in items if n.endswith("lora_A.weight")][1:],
    "wrong dtype": lambda items: [(n, t.float()) if i == 0 else (n, t)
                                  for i, (n, t) in enumerate(items)],
    "another rank": lambda items: [(n, t[:-1] if n.endswith("lora_A.weight") and i == 0 else t)
                                   for i, (n, t) in enumerate(items)],
    "a module the adapter does not target": lambda items: items + [
        ("lm_head.lora_A.weight", items[0][1])],
    "the 3-D expert layout": lambda items: [(n, t) for n, t in items if ".experts." not in n]
    + [(f"model.layers.0.mlp.experts.gate_up_proj.lora_{w}.weight", items[0][1])
       for w in ("A", "B")],
}


@pytest.mark.weightsync_property("lora_coverage")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", lora.CASE_PARAMS)
def test_every_targeted_module_gets_a_and_b_and_nothing_else(weightsync_adapter_loader, case,
                                                             layout):
    from pytest_weightsync import compare
    from pytest_weightsync.reference_impl.model.adapter_layout import adapter_buffers, pieces_of
    from pytest_weightsync.reference_impl.model.adapter_spec import lora_params

    impl = weightsync_adapter_loader
    _claimed(impl, layout)
    items = lora.payload(case.adapter, 1)
    reached = set()
    for rank in _ranks(case):
        reached |= set(pieces_of(adapter_buffers(case.adapter, case.receiver, rank, layout,
                                                 lora.SLOTS)))
        params, slots = lora.engine_state(case, rank, layout)
        lora.load(impl, case, rank, layout, params, slots, items, slot=2)
        before = compare.snapshot({**params, **{f"slot:{n}": t for n, t in slots.items()}})
        for bad, make in BAD_PAYLOADS.items():
            if bad == "the 3-D expert layout" and not case.adapter.experts:
                continue
            try:
                lora.load(impl, case, rank, layout, params, slots, make(items), slot=2)
            except Exception:  # noqa: BLE001 - refused: what matters is that nothing moved
                pass
            else:
                raise lora.LoraConformanceError(
                    f"{impl.name} ({layout}) accepted an adapter with {bad} on rank {rank}; an "
                    f"engine refuses it before writing anything")
            compare.assert_unchanged(before, {**params, **{f"slot:{n}": t
                                                           for n, t in slots.items()}},
                                     rank=rank)
        lora.check_slots(impl, case, rank, layout, slots, {2: 1}, "after refused adapters")
    wanted = {n for p in lora_params(case.adapter).values() for n in (p.a_name, p.b_name)}
    assert reached == wanted, sorted(wanted ^ reached)[:4]  # the layout places every tensor


@pytest.mark.weightsync_property("lora_scale_once")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", lora.CASE_PARAMS[:3])
def test_scaling_is_applied_once_also_after_evict_and_rebuild(weightsync_adapter_loader, case,
                                                              layout):
    from pytest_weightsync import compare

    impl = weightsync_adapter_loader
    _claimed(impl, layout)
    staged = lora.payload(case.adapter, 1)  # the same tensors, every load
    kept = compare.snapshot(dict(staged))
    for rank in _ranks(case):
        params, slots = lora.engine_state(case, rank, layout)
        for slot in (1, 1, 3):  # twice into slot 1 (a rebuild), then another slot
            if slot == 1 and callable(getattr(impl, "evict_adapter", None)):
                lora.calls.call(impl, "evict_adapter", slots, adapter=case.adapter,
                                topology=case.receiver, rank=rank, slot=1, layout=layout)
            lora.load(impl, case, rank, layout, params, slots, staged, slot=slot)
        lora.check_slots(impl, case, rank, layout, slots, {1: 1, 3: 1},
                         "evicted, rebuilt from the same staged tensors, and a second slot")
    try:
        compare.assert_unchanged(kept, dict(staged))
    except compare.ComparisonError as error:
        raise lora.LoraConformanceError(
            f"{impl.name} ({layout}) changed the staged adapter tensors it loaded: {error} - the "
            f"scaling folded in place (a rebuild from them scales twice)") from None


@pytest.mark.weightsync_property("base_untouched")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", lora.CASE_PARAMS[::2])
def test_base_weights_are_untouched_by_adapter_syncs(weightsync_adapter_loader, case, layout):
    from pytest_weightsync import compare

    impl = weightsync_adapter_loader
    _claimed(impl, layout)
    for rank in _ranks(case):
        params, slots = lora.engine_state(case, rank, layout)
        before = compare.snapshot(params)
        for version, slot in ((1, 1), (2, 2), (3, 1)):
            lora.load(impl, case, rank, layout, params, slots, lora.payload(case.adapter, version),
                      slot=slot)
        try:
            compare.assert_unchanged(before, params, rank=rank)
        except compare.ComparisonError as error:
            raise lora.LoraConformanceError(
                f"{impl.name} ({layout}): {error} - an adapter written into the base weights") \
                from None


@pytest.mark.weightsync_property("lora_versions")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", lora.CASE_PARAMS[1:])
def test_a_new_version_replaces_the_old_and_adapters_coexist(weightsync_adapter_loader, case,
                                                            layout):
    impl = weightsync_adapter_loader
    _claimed(impl, layout)
    for rank in _ranks(case):
        params, slots = lora.engine_state(case, rank, layout)
        lora.load(impl, case, rank, layout, params, slots, lora.payload(case.adapter, 1), slot=1)
        lora.load(impl, case, rank, layout, params, slots, lora.payload(case.adapter, 2), slot=2)
        lora.load(impl, case, rank, layout, params, slots, lora.payload(case.adapter, 3), slot=1)
        lora.check_slots(impl, case, rank, layout, slots, {1: 3, 2: 2},
                         "version 3 over version 1 in slot 1, version 2 in slot 2")
        broken = lora.payload(case.adapter, 4)
        name, tensor = broken[-1]
        broken[-1] = (name, tensor[:-1])  # the last tensor cut short: the load must fail whole
        try:
            lora.load(impl, case, rank, layout, params, slots, broken, slot=1)
        except Exception:  # noqa: BLE001 - refused
            pass
        lora.check_slots(impl, case, rank, layout, slots, {1: 3, 2: 2},
                         "after a refused load of version 4 into slot 1 (no mix of 3 and 4)")


@pytest.mark.weightsync_property("lora_bit_exact")
@pytest.mark.parametrize("case", lora.EXPORT_PARAMS)
def test_an_exported_adapter_lands_bit_exact_on_every_rank(weightsync_adapter_exporter, case):
    lora.export_and_check(weightsync_adapter_exporter, case)


@pytest.mark.weightsync_property("lora_merged")
@pytest.mark.parametrize("case", lora.CASE_PARAMS)
def test_the_merged_path_equals_the_oracle_merge(weightsync_adapter_merger, case):
    lora.merge_and_check(weightsync_adapter_merger, case)
