"""Component-ordered tensor-parallel gathers: GLU fc1, GDN in_proj and conv1d, attention QKV
(SGLang-style `[q; k; v]` and Megatron's per-query-group `linear_qkv`).

The unsharded tensors and every rank's shard are built here by slicing each component (the
shard of TP rank ``r`` is ``[c_0[r-th block]; c_1[r-th block]; ...]``). The check names the
component, source rank and row of the first wrong row, so a gather that concatenates whole
shards - same shape, rows in the wrong order - fails with a message that says where.
"""

from __future__ import annotations

import pytest
from .located_bits import assert_component_bits

from pytest_weightsync.reference_impl.trainer.component_gather import (
    ComponentLayout,
    ComponentLayoutError,
    assemble_components,
    gdn_conv1d_layout,
    gdn_in_proj_layout,
    glu_fc1_layout,
    qkv_layout,
    shard_of,
)

pytestmark = pytest.mark.weightsync_property("component-gather")

# GDN with 2 key heads and 4 value heads of dim 2 (Qwen3.5 has 16 / 32 of dim 128).
LAYOUTS = {
    "glu_fc1": glu_fc1_layout(8),
    "gdn_in_proj": gdn_in_proj_layout(2, 2, 2, 4),
    "gdn_conv1d": gdn_conv1d_layout(2, 2, 2, 4),
    "qkv": qkv_layout(8, 4),
}


def unsharded(layout: ComponentLayout, cols: int = 3):
    """Every element's bits distinct and readable: ``component * 4096 + row * 64 + col``."""
    import torch

    rows = []
    for index, size in enumerate(layout.sizes):
        rows.append(torch.arange(size).unsqueeze(1) * 64 + torch.arange(cols) + 4096 * index)
    return torch.cat(rows).to(torch.int16).view(torch.bfloat16)


def shards_by_slicing(full, layout: ComponentLayout, tp: int) -> list:
    """Each rank's shard, built component by component from the unsharded tensor."""
    import torch

    out = []
    for rank in range(tp):
        pieces, start = [], 0
        for size in layout.sizes:
            block = size // tp
            pieces.append(full[start + rank * block : start + (rank + 1) * block])
            start += size
        out.append(torch.cat(pieces))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_single_process_assembly_restores_the_unsharded_tensor(name, tp):
    layout = LAYOUTS[name]
    full = unsharded(layout)
    shards = shards_by_slicing(full, layout, tp)
    assert_component_bits(assemble_components(shards, layout), full, layout, tp)
    for rank, shard in enumerate(shards):
        assert_component_bits(shard_of(full, layout, tp, rank), shard, ComponentLayout("shard", ("all",), (shard.shape[0],)), 1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_concatenated_shards_are_caught_with_the_first_wrong_component(name):
    import torch

    layout = LAYOUTS[name]
    full = unsharded(layout)
    shards = shards_by_slicing(full, layout, 2)
    naive = torch.cat(shards)
    first = layout.sizes[0]
    with pytest.raises(AssertionError, match=rf"row {first // 2} \(component '{layout.components[0]}', row 0 of TP rank 1's block\)"):
        assert_component_bits(naive, full, layout, 2)


def test_three_dimensional_conv_weights_are_gathered_along_dim_0():
    import torch

    layout = LAYOUTS["gdn_conv1d"]
    full = torch.arange(layout.rows * 4, dtype=torch.float32).reshape(layout.rows, 1, 4).to(torch.bfloat16)
    shards = shards_by_slicing(full, layout, 2)
    assert_component_bits(assemble_components(shards, layout), full, layout, 2)


def test_components_that_do_not_divide_by_tp_are_rejected():
    with pytest.raises(ComponentLayoutError, match=r"gdn_in_proj: components \[\('b', 3\), \('a', 3\)\] do not divide by TP size 2"):
        gdn_in_proj_layout(2, 2, 2, 3).shard_sizes(2)


def test_a_shard_of_the_wrong_height_is_rejected():
    import torch

    layout = LAYOUTS["glu_fc1"]
    with pytest.raises(ComponentLayoutError, match=r"shard of rank 1 has \(7, 3\), dim 0 must be 8"):
        assemble_components([torch.zeros(8, 3), torch.zeros(7, 3)], layout)


def gather_both_ways(name: str) -> dict:
    """Rank body: sequential and async gathers of this rank's shard, checked against the full tensor."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.component_gather import gather_components_async, gather_components_sequential

    torch.set_num_threads(1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    layout = LAYOUTS[name]
    full = unsharded(layout)
    shard = shards_by_slicing(full, layout, tp)[rank]
    sequential = gather_components_sequential(shard, layout)
    overlapped = gather_components_async(shard, layout)
    assert_component_bits(sequential, full, layout, tp)
    assert_component_bits(overlapped, sequential, layout, tp)
    return {"sequential": sequential.view(torch.int16).tolist(), "async": overlapped.view(torch.int16).tolist()}


@pytest.mark.parametrize(
    "name, tp",
    [("glu_fc1", 2), ("gdn_in_proj", 2), ("gdn_in_proj", 4), ("gdn_conv1d", 2), ("qkv", 4)],
)
def test_async_gather_equals_sequential_gather_across_ranks(rank_pool, name, tp):
    results = rank_pool.run(gather_both_ways, tp, name)
    assert all(r == results[0] for r in results), "ranks disagree on the gathered tensor"
    assert results[0]["sequential"] == results[0]["async"]


# Megatron's attention linear_qkv: interleaved per query group, TP shards = whole groups.
HEADS, QUERY_GROUPS, HEAD_DIM = 8, 4, 2


def _hf_qkv():
    """HF q_proj / k_proj / v_proj with distinct, readable bits (component tag * 4096 + row * 64 + col)."""
    full = unsharded(qkv_layout(HEADS * HEAD_DIM, QUERY_GROUPS * HEAD_DIM))
    import torch

    return torch.split(full, [HEADS * HEAD_DIM, QUERY_GROUPS * HEAD_DIM, QUERY_GROUPS * HEAD_DIM])


def test_megatron_qkv_interleaves_each_query_group_as_q_heads_then_k_then_v():
    import torch

    from pytest_weightsync.reference_impl.trainer.component_gather import interleave_qkv, split_megatron_qkv

    q, k, v = _hf_qkv()
    qkv = interleave_qkv(q, k, v, HEADS, QUERY_GROUPS, HEAD_DIM)
    per_group = (HEADS // QUERY_GROUPS + 2) * HEAD_DIM
    for g in range(QUERY_GROUPS):
        block = qkv[g * per_group:(g + 1) * per_group]
        heads = HEADS // QUERY_GROUPS * HEAD_DIM
        expected = torch.cat([q[g * heads:(g + 1) * heads], k[g * HEAD_DIM:(g + 1) * HEAD_DIM], v[g * HEAD_DIM:(g + 1) * HEAD_DIM]])
        assert torch.equal(block.view(torch.int16), expected.view(torch.int16)), f"query group {g}"
    for name, got, want in zip("qkv", split_megatron_qkv(qkv, HEADS, QUERY_GROUPS, HEAD_DIM), (q, k, v)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_qkv_gathers_by_concatenation_and_not_as_q_k_v_components(tp):
    import torch

    from pytest_weightsync.reference_impl.trainer.component_gather import interleave_qkv, megatron_qkv_layout

    q, k, v = _hf_qkv()
    qkv = interleave_qkv(q, k, v, HEADS, QUERY_GROUPS, HEAD_DIM)
    layout = megatron_qkv_layout(HEADS, QUERY_GROUPS, HEAD_DIM, tp)
    shards = [shard_of(qkv, layout, tp, r) for r in range(tp)]
    rows = qkv.shape[0] // tp
    for r, shard in enumerate(shards):  # whole query groups: a contiguous slice
        assert torch.equal(shard.view(torch.int16), qkv[r * rows:(r + 1) * rows].view(torch.int16))
    assert torch.equal(assemble_components(shards, layout).view(torch.int16), qkv.view(torch.int16))
    hf_style = assemble_components(shards, qkv_layout(HEADS * HEAD_DIM, QUERY_GROUPS * HEAD_DIM))
    assert not torch.equal(hf_style.view(torch.int16), qkv.view(torch.int16)), "a [q; k; v] gather matched Megatron's layout"


def test_megatron_qkv_rejects_groups_that_do_not_divide_by_tp():
    from pytest_weightsync.reference_impl.trainer.component_gather import MegatronQKVError, megatron_qkv_layout

    with pytest.raises(MegatronQKVError, match=r"num_query_groups=2 does not divide by TP size 4"):
        megatron_qkv_layout(8, 2, 2, 4)
    with pytest.raises(MegatronQKVError, match=r"num_heads=6 is not divisible by num_query_groups=4"):
        megatron_qkv_layout(6, 4, 2)
