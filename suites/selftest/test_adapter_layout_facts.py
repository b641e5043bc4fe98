"""The adapter layouts agree with the facts read from the real engines.

``reference_impl/model/adapter_layout.py`` places every A and B; ``reference_impl/backends/lora_facts.py``
holds what SGLang 0.5.23 and vLLM 0.33.0 do (each fact held to the installed code or the wheel
by ``test_lora_source.py``). Here the layout is held to those facts on every adapter case and
engine rank: the buffer shapes (SGLang's ``get_lora_A_shape`` / ``get_lora_B_shape`` symbols,
vLLM's fused-MoE buffers), the stacking order, which factor is sliced for a row-parallel module,
and where ``alpha / r`` is applied. A fact that changes fails here before a layout can drift.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.backends import lora_facts as facts
from pytest_weightsync.reference_impl.model.adapter_layout import SCALINGS, adapter_buffers
from pytest_weightsync.reference_impl.model.adapter_spec import lora_params
from pytest_weightsync.reference_impl.model.layout import receiver_shard

from ..harness import lora

pytestmark = pytest.mark.weightsync_property("receiver_layout")

RANKED = [pytest.param(c, r, id=f"{c.id}-rank{r}") for c in lora.ADAPTER_CASES
          for r in range(c.receiver.tp)]


def _kind(name: str) -> str:
    return name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1]


@pytest.mark.parametrize("case, rank", RANKED)
def test_sglang_buffers_have_the_memory_pools_shapes_and_stacking(case, rank):
    shapes, _ = facts.SGLANG_BUFFER_SHAPES
    stack, _ = facts.SGLANG_STACKED_MULTIPLY
    order, _ = facts.SGLANG_STACK_ORDER
    rows, _ = facts.SGLANG_ROW_PARALLEL_MODULES
    adapter, r = case.adapter, case.adapter.rank
    shard = receiver_shard(adapter.model.experts, case.receiver, rank)
    buffers = adapter_buffers(adapter, case.receiver, rank, "sglang", lora.SLOTS)
    assert buffers[SCALINGS].shape == (lora.SLOTS,)
    for name, buf in buffers.items():
        if name == SCALINGS:
            continue
        which = "A" if ".lora_A" in name else "B"
        if ".experts." in name:
            module = "gate_up_proj_moe" if ".gate_up." in name else "down_proj_moe"
            symbols = shapes[f"{which}_moe"]
            assert buf.shape[:2] == (lora.SLOTS, len(shard.experts)), name
            if which == "A":
                assert buf.shape[2] == r * stack[module], name
            continue
        module = _kind(name)
        row = module in rows
        symbols = shapes[which + ("_row" if row else "")]
        assert len(buf.shape) == len(symbols), (name, symbols)
        if which == "A":
            assert buf.shape[1] == r * stack.get(module, 1), (name, buf.shape)
            if module in order:  # A stacked in the engine's order, every source
                starts = {p.tensor.split(".")[-3]: p.dst_start for p in buf.pieces}
                assert [starts[s] for s in order[module] if s in starts] == sorted(
                    starts[s] for s in order[module] if s in starts), (name, starts)
        else:
            assert buf.shape[2] == r, name
        for piece in buf.pieces:  # a row module slices A's columns, every other B's rows
            if row and which == "A":
                assert piece.src_dim == 1, (name, piece)
            elif which == "B" and not row:
                assert piece.src_dim == 0, (name, piece)


@pytest.mark.parametrize("case, rank", RANKED)
def test_the_scaling_is_where_each_engine_applies_it(case, rank):
    kept, _ = facts.SGLANG_SCALE_KEPT_FOR_DENSE
    moe_folded, _ = facts.SGLANG_SCALE_FOLDED_FOR_MOE
    vllm_fold, _ = facts.VLLM_FOLD
    assert kept and moe_folded and vllm_fold.startswith("lora_b *= scaling")
    for layout in ("sglang", "vllm"):
        for name, buf in adapter_buffers(case.adapter, case.receiver, rank, layout,
                                         lora.SLOTS).items():
            for piece in buf.pieces:
                is_b = piece.tensor.endswith("lora_B.weight")
                expected = is_b and (layout == "vllm" or ".experts." in name)
                assert piece.scaled == expected, (layout, name, piece)


@pytest.mark.parametrize("case, rank", RANKED)
def test_vllm_expert_buffers_have_the_fused_moe_shapes(case, rank):
    shapes, _ = facts.VLLM_MOE_BUFFER_SHAPES
    adapter = case.adapter
    shard = receiver_shard(adapter.model.experts, case.receiver, rank)
    values = {"max_loras": lora.SLOTS, "E_local": len(shard.experts), "max_rank": adapter.rank,
              "hidden": adapter.model.hidden, "inter_tp": shard.rows}
    buffers = adapter_buffers(adapter, case.receiver, rank, "vllm", lora.SLOTS)
    seen = set()
    for name, buf in buffers.items():
        if ".experts." not in name:
            continue
        key = ("w13" if ".w13." in name else "w2") + ("_lora_a" if ".lora_A" in name
                                                     else "_lora_b")
        assert buf.shape == tuple(values[s] for s in shapes[key]), (name, buf.shape)
        seen.add(key)
    wanted = {p.module for p in lora_params(adapter).values() if p.expert is not None}
    assert bool(seen) == bool(wanted)


def test_a_changed_fact_is_caught(monkeypatch):
    """The stacking order of SGLang's qkv reversed in the facts: the layout no longer agrees."""
    order, source = facts.SGLANG_STACK_ORDER
    monkeypatch.setattr(facts, "SGLANG_STACK_ORDER",
                        ({**order, "qkv_proj": tuple(reversed(order["qkv_proj"]))}, source))
    case = lora.ADAPTER_CASES[0]
    with pytest.raises(AssertionError):
        test_sglang_buffers_have_the_memory_pools_shapes_and_stacking(case, 0)
