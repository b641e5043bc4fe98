"""Splitting a named-tensor stream into buckets the way trainers do before sending.

Real exporters (slime's ``update_weight_buffer_size``, verl's bucketed sync) fill a bucket
until the next tensor would push it past a byte limit, then send it and start the next one.
So one layer's experts routinely straddle two buckets and one bucket can hold several layers;
a tensor larger than the limit travels alone. Receivers must accept every such split.

What a limit means to a real exporter is looser than what :func:`split_buckets` does: its
smallest unit is the conversion of one source parameter (one fused ``linear_fc1`` becomes
``gate_proj`` + ``up_proj``; slime converts a whole EP-gathered batch), so a bucket may exceed
``bucket_bytes`` by ONE UNIT - without its largest unit it must fit
(:func:`bucket_limit_findings`). A per-expert ``gate_proj`` / ``up_proj`` pair of one
(layer, expert) is one unit; every other entry is a unit of its own.
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


def _unit_key(name: str, index: int):
    """The source parameter an entry was converted from, as far as its name tells."""
    from pytest_weightsync.reference_impl.model.layout import parse_receiver_name

    parsed = parse_receiver_name(name)
    if parsed is not None and parsed.kind == "expert" and parsed.projection in ("gate", "up"):
        return ("linear_fc1", parsed.layer, parsed.expert)
    return ("entry", index)


def bucket_units(bucket) -> dict:
    """``{unit: bytes}`` of one bucket, in order of appearance (see the module docstring)."""
    units: dict = {}
    for index, (name, tensor) in enumerate(bucket):
        key = _unit_key(name, index)
        units[key] = units.get(key, 0) + tensor_bytes(tensor)
    return units


def bucket_limit_findings(stream, bucket_bytes: Optional[int], source: str) -> list[str]:
    """One line per bucket of ``stream`` that exceeds ``bucket_bytes`` by more than one unit
    (without its largest unit it still does not fit); ``None``: no limit, nothing found."""
    if bucket_bytes is None:
        return []
    found = []
    for index, bucket in enumerate(stream):
        units = bucket_units(bucket)
        size = sum(units.values())
        largest = max(units.values(), default=0)
        if size <= bucket_bytes or size - largest <= bucket_bytes:
            continue
        found.append(f"{source}: bucket {index} holds {len(bucket)} tensors in {len(units)} "
                     f"units, {size} bytes; without its largest unit ({largest} bytes) it "
                     f"still exceeds bucket_bytes={bucket_bytes} (a bucket may exceed the "
                     f"limit by one unit only: the conversion of one source parameter)")
    return found
