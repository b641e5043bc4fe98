"""Splitting a named-tensor stream into buckets the way trainers do before sending.

Real exporters (slime's ``update_weight_buffer_size``, verl's bucketed sync) fill a bucket
until the next tensor would push it past a byte limit, then send it and start the next one.
So one layer's experts routinely straddle two buckets and one bucket can hold several layers;
a tensor larger than the limit travels alone. Receivers must accept every such split.
"""

from __future__ import annotations

from typing import Iterable, Optional

from pytest_weightsync.reference_impl.errors import WeightSyncError, shown


class BucketEntryError(WeightSyncError, TypeError):
    """An entry of a named-tensor stream that is not a ``(name, tensor)`` pair."""


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _checked(index: int, item) -> tuple[str, object]:
    """``item`` as ``(name, tensor)``, or :class:`BucketEntryError` naming entry ``index``."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
        raise BucketEntryError(f"entry {index} of the stream is a {type(item).__name__}, not a "
                               f"(name, tensor) pair: {item!r:.80}")
    name, tensor = item
    # Duck-typed so this module stays free of torch: what a bucket limit needs is a size.
    if not (callable(getattr(tensor, "numel", None))
            and callable(getattr(tensor, "element_size", None))):
        raise BucketEntryError(f"entry {index} {shown(name)} of the stream is a "
                               f"{type(tensor).__name__}, not a tensor")
    return name, tensor


def split_buckets(named_tensors: Iterable[tuple[str, object]],
                  bucket_bytes: Optional[int]) -> list[list[tuple[str, object]]]:
    """``named_tensors`` in order, cut into buckets of at most ``bucket_bytes`` bytes (a
    single tensor larger than that is a bucket of its own). ``None`` means one bucket holding
    everything; ``0`` one tensor per bucket."""
    items = [_checked(index, item) for index, item in enumerate(named_tensors)]
    if bucket_bytes is None:
        return [items] if items else []
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise WeightSyncError(f"bucket_bytes must be None or an int >= 0, got {bucket_bytes!r}")
    buckets, current, size = [], [], 0
    for name, tensor in items:
        nbytes = tensor_bytes(tensor)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
