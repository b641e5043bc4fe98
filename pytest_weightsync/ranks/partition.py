"""Which GPUs the ranks of one xdist worker may use.

With ``pytest -n N`` on a multi-GPU host every xdist worker would otherwise start its ranks on
GPU 0.. and NCCL groups of different workers would pile onto the same devices. Each worker
instead takes a contiguous block of the visible GPUs, computed from nothing but its id and the
worker count, so the split is predictable and testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "devices_for_pool", "parse_visible", "partition_gpus", "xdist_worker_index",
]


def xdist_worker_index(worker_id: str | None) -> int | None:
    """``"gw3"`` -> 3; None (or ``"master"``) when not running inside an xdist worker."""
    if not worker_id or not worker_id.startswith("gw"):
        return None
    try:
        return int(worker_id[2:])
    except ValueError:
        raise ValueError(
            f"PYTEST_XDIST_WORKER={worker_id!r} is not of the form 'gw<index>'"
        ) from None


def partition_gpus(
    visible: Sequence[str], worker_index: int | None, worker_count: int | None
) -> tuple[str, ...]:
    """The GPUs (ids as in ``CUDA_VISIBLE_DEVICES``) that xdist worker ``worker_index`` owns.

    Blocks are contiguous and as even as possible: 8 GPUs over 3 workers give 2, 3 and 3
    (GPUs sharing a switch stay together). With more workers than GPUs each worker gets one
    GPU, round robin, since giving a worker none would make every GPU test skip there.
    Outside xdist (index or count None) everything visible is returned.
    """
    visible = tuple(visible)
    if worker_index is None or worker_count is None or not visible:
        return visible
    if worker_count < 1 or not 0 <= worker_index < worker_count:
        raise ValueError(
            f"xdist worker index {worker_index} is outside 0..{worker_count - 1} "
            f"(PYTEST_XDIST_WORKER / PYTEST_XDIST_WORKER_COUNT)"
        )
    n = len(visible)
    if worker_count > n:
        return (visible[worker_index % n],)
    start = worker_index * n // worker_count
    stop = (worker_index + 1) * n // worker_count
    return visible[start:stop]


def devices_for_pool(
    visible: Sequence[str], worker_index: int | None, worker_count: int | None, needed: int
) -> tuple[str, ...]:
    """The GPUs a pool of ``needed`` NCCL ranks should see from this xdist worker.

    NCCL refuses two ranks of one group on one GPU, so when the worker's own block is smaller
    than the pool, the block is widened to ``needed`` GPUs starting at the block's first GPU
    (wrapping around): the pool then shares GPUs with a neighbouring worker instead of failing.
    When fewer GPUs are visible than needed, all of them are returned and the gpu marker's
    own check decides.
    """
    visible = tuple(visible)
    own = partition_gpus(visible, worker_index, worker_count)
    if len(own) >= needed or len(visible) <= needed:
        return own if len(own) >= needed else visible
    start = visible.index(own[0])
    return tuple(visible[(start + i) % len(visible)] for i in range(needed))


def parse_visible(cuda_visible_devices: str | None, device_count: int) -> tuple[str, ...]:
    """The visible GPU ids: the entries of ``CUDA_VISIBLE_DEVICES`` or ``0..device_count-1``."""
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(device_count))
    ids = tuple(p.strip() for p in cuda_visible_devices.split(",") if p.strip())
    return ids[:device_count] if device_count else ids
