"""The xdist GPU partition is pure: checked here without any GPU."""

import pytest

from pytest_weightsync.ranks import dispatch
from pytest_weightsync.ranks.partition import (
    devices_for_pool,
    parse_visible,
    partition_gpus,
    xdist_worker_index,
)

EIGHT = tuple(str(i) for i in range(8))


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, [EIGHT]),
        (2, [("0", "1", "2", "3"), ("4", "5", "6", "7")]),
        (3, [("0", "1"), ("2", "3", "4"), ("5", "6", "7")]),
        (8, [(str(i),) for i in range(8)]),
    ],
)
def test_blocks_are_contiguous_disjoint_and_cover_every_gpu(count, expected):
    blocks = [partition_gpus(EIGHT, i, count) for i in range(count)]
    assert blocks == expected
    assert sorted(g for b in blocks for g in b) == sorted(EIGHT)


def test_more_workers_than_gpus_share_round_robin():
    assert [partition_gpus(("a", "b"), i, 5) for i in range(5)] == [("a",), ("b",), ("a",), ("b",), ("a",)]


def test_outside_xdist_everything_is_visible():
    assert partition_gpus(EIGHT, None, None) == EIGHT
    assert partition_gpus((), 1, 2) == ()


def test_uuid_ids_are_kept_verbatim():
    ids = ("GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd")
    assert partition_gpus(ids, 1, 2) == ("GPU-ccc", "GPU-ddd")


def test_out_of_range_worker_is_rejected_with_the_values():
    with pytest.raises(ValueError, match=r"index 2 is outside 0\.\.1"):
        partition_gpus(EIGHT, 2, 2)


def test_pool_widens_a_too_small_block_to_distinct_gpus():
    # 4 workers on 8 GPUs own 2 each; a 4-rank NCCL pool on worker 3 needs 4 distinct GPUs.
    assert devices_for_pool(EIGHT, 3, 4, 2) == ("6", "7")
    assert devices_for_pool(EIGHT, 3, 4, 4) == ("6", "7", "0", "1")
    assert devices_for_pool(("0", "1"), 0, 2, 4) == ("0", "1")  # gpu marker decides


def test_worker_index_parsing():
    assert xdist_worker_index("gw12") == 12
    assert xdist_worker_index(None) is None
    assert xdist_worker_index("master") is None
    with pytest.raises(ValueError, match="gwx"):
        xdist_worker_index("gwx")


def test_visible_ids_from_env_or_count():
    assert parse_visible(None, 3) == ("0", "1", "2")
    assert parse_visible("3, 5,7", 3) == ("3", "5", "7")


def test_rank_devices_only_partitions_nccl_pools_inside_xdist(monkeypatch):
    monkeypatch.setattr(dispatch, "_gpu_count", lambda: 4)
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert dispatch.rank_devices("nccl", 2, env) == ("6", "7")
    assert dispatch.rank_devices("gloo", 2, env) is None
    assert dispatch.rank_devices("nccl", 2, {}) is None
