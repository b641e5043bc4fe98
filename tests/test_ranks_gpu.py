"""NCCL ranks on real GPUs (skipped on CPU-only machines by the ``gpu`` marker).

Run these directly on a multi-GPU host, also under ``-n 2`` to check the per-worker GPU split.
"""

import os

import pytest


def device_and_sum():
    import torch
    import torch.distributed as dist

    from pytest_weightsync.ranks import current

    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return current().device, str(t.device), t.sum().item(), dist.get_backend()


@pytest.mark.gpu(n=2)
@pytest.mark.ranks(2)
def test_nccl_ranks_get_their_own_gpu():
    import torch
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    assert torch.cuda.current_device() == dist.get_rank() % torch.cuda.device_count()
    t = torch.ones(8, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), 3.0, device="cuda"))


@pytest.mark.gpu(n=2)
def test_rank_pool_runs_nccl_with_cuda_tensors(rank_pool):
    results = rank_pool.run(device_and_sum, 2)
    assert results == [("cuda:0", "cuda:0", 12.0, "nccl"), ("cuda:1", "cuda:1", 12.0, "nccl")]


@pytest.mark.gpu
def test_single_nccl_rank(rank_pool):
    assert rank_pool.run(device_and_sum, 1) == [("cuda:0", "cuda:0", 4.0, "nccl")]


@pytest.mark.gpu
@pytest.mark.ranks(1)
@pytest.mark.parametrize("i", range(4))
def test_xdist_worker_ranks_see_their_gpu_block(i):
    from pytest_weightsync.ranks.partition import partition_gpus, xdist_worker_index

    worker = xdist_worker_index(os.environ.get("PYTEST_XDIST_WORKER"))
    if worker is None:
        pytest.skip("only meaningful under pytest-xdist (-n N)")
    visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    # The rank was given its worker's block; the block is non-empty and one GPU per rank fits.
    assert len(visible) >= 1
    print(f"worker gw{worker}/{count} ranks see CUDA_VISIBLE_DEVICES={visible}")


def nccl_subgroup(destroy: bool):
    import torch
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    if destroy:
        dist.destroy_process_group(group)
    return t[0].item()


@pytest.mark.gpu
def test_nccl_subgroups_left_behind_are_named_and_destroyed_ones_are_not(rank_pool):
    """NCCL creates threads and communicators lazily; a destroyed subgroup must not read as a
    leak, one left behind must (see tests/test_ranks_hygiene.py for gloo)."""
    import warnings

    from pytest_weightsync.ranks import RankLeakWarning

    def leaks(destroy):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert rank_pool.run(nccl_subgroup, 1, destroy) == [1.0]
        return [str(w.message) for w in caught if issubclass(w.category, RankLeakWarning)]

    for _ in range(3):
        assert leaks(True) == []
    found = leaks(False)
    assert len(found) == 1 and "rank 0: +1 process group" in found[0], found
