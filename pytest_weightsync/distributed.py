"""Calling a distributed exporter inside a trainer rank, and checking what it did there.

A distributed exporter (``export_weights_distributed``, see :mod:`pytest_weightsync.protocols`)
runs in every rank of a real ``torch.distributed`` job and does its own collectives, so the
harness cannot look over its shoulder from one process. This module is the part of the
harness that runs in each rank: it calls the exporter once per update, then checks right
there, before anything is pickled back, that

* the call left every trainer parameter bit-identical (an exporter that regroups fc1 in place
  corrupts the next training step; the message names the call, the rank, the parameter and the
  first changed row/col);
* the result has the shape the delivery mode promises (a stream per colocated rank; a
  ``{engine_rank: stream}`` map from rank 0 and nothing from the others);
* every entry carries a plain tensor (a lock, a list or a DTensor is named by bucket and
  entry, not met later as an ``AttributeError`` of a copy);
* no bucket exceeds ``bucket_bytes`` unless it holds a single tensor.

Tensors are copied out of the exporter's buffers before they travel (a view would pickle its
whole storage). Nothing here knows the reference implementation: the values are judged in the
pytest process, by the suite, against an independent oracle. torch is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from pytest_weightsync.protocols import DELIVERIES, as_stream, colocated_engine_rank


class DistributedExportError(AssertionError):
    """A distributed exporter broke its contract in a rank (modified its inputs, returned the
    wrong shape of result, overfilled a bucket). The message names the call and the rank."""


@dataclass
class RankExport:
    """What one trainer rank's exporter call produced: ``streams`` maps an engine rank to the
    bucket stream this trainer rank sent it (empty for a non-sender in distributed mode)."""

    trainer_rank: int
    streams: dict


def snapshot(named: Mapping) -> dict:
    """Detached copies of every tensor in ``named`` (the exporter's inputs)."""
    return {name: tensor.detach().clone() for name, tensor in named.items()}


def _index_text(index: tuple) -> str:
    if len(index) == 2:
        return f"row {index[0]} col {index[1]}"
    if len(index) == 1:
        return f"element {index[0]}"
    return f"index {list(index)}"


def first_modification(before: Mapping, after: Mapping) -> Optional[str]:
    """``"NAME at row R col C"`` for the first parameter of ``before`` whose bits, shape or
    dtype changed in ``after`` (or that disappeared), else ``None``."""
    from pytest_weightsync.compare import first_difference

    for name, old in before.items():
        new = after.get(name)
        if new is None:
            return f"{name} (no longer in the state)"
        if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
            return (f"{name} (now {tuple(new.shape)} {new.dtype}, was {tuple(old.shape)} "
                    f"{old.dtype})")
        found = first_difference(new, old)
        if found is not None:
            return f"{name} at {_index_text(found[1])}"
    return None


def check_inputs_unchanged(before: Mapping, after: Mapping, *, call: str, owner: str) -> None:
    """Raise :class:`DistributedExportError` when ``call`` modified one of ``owner``'s inputs,
    e.g. ``export call for update 1 (compat, colocated) modified trainer rank 1's shard
    module.module.decoder.layers.0...linear_fc1.weight at row 3 col 0``."""
    where = first_modification(before, after)
    if where is not None:
        raise DistributedExportError(f"{call} modified {owner}'s shard {where}")


def check_tensors(stream, source: str) -> None:
    """Every entry of ``stream`` carries a plain ``torch.Tensor`` (or ``nn.Parameter``): what
    an engine's loader reads. A lock, a list, a DTensor or another subclass is named with its
    bucket and entry here, in the rank, before anything tries to copy or pickle it."""
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    for index, bucket in enumerate(stream):
        for j, (name, tensor) in enumerate(bucket):
            if type(tensor) in plain:
                continue
            cls = type(tensor)
            what = (f"a tensor subclass ({cls.__module__}.{cls.__qualname__}), not a plain "
                    f"torch.Tensor" if isinstance(tensor, torch.Tensor) else
                    f"a {cls.__qualname__}, not a torch.Tensor")
            raise DistributedExportError(f"{source}: bucket {index} entry {j} {name!r:.120} is "
                                         f"{what}; a stream carries (name, tensor) pairs of "
                                         f"plain tensors")


def _copied(stream) -> list:
    return [[(name, tensor.detach().clone()) for name, tensor in bucket] for bucket in stream]


def check_bucket_limit(stream, bucket_bytes: Optional[int], source: str) -> None:
    """Every bucket of ``stream`` within ``bucket_bytes``, unless it holds one tensor."""
    if bucket_bytes is None:
        return
    for index, bucket in enumerate(stream):
        size = sum(t.numel() * t.element_size() for _, t in bucket
                   if hasattr(t, "element_size"))
        if len(bucket) > 1 and size > bucket_bytes:
            raise DistributedExportError(
                f"{source}: bucket {index} holds {len(bucket)} tensors, {size} bytes, over the "
                f"bucket_bytes={bucket_bytes} limit (only a single tensor may exceed it)")


def normalize_result(result, *, delivery: str, rank: int, receiver, bucket_bytes, source: str
                     ) -> dict:
    """The exporter's ``result`` in trainer rank ``rank`` as ``{engine_rank: stream}``
    (tensors copied), or :class:`DistributedExportError` naming what is wrong with it."""
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery must be one of {DELIVERIES}, got {delivery!r}")
    if delivery == "colocated":
        try:
            stream = as_stream(result, source=source)
        except TypeError as error:
            raise DistributedExportError(f"{error} (colocated delivery: every trainer rank "
                                         f"returns the stream of its colocated engine rank)") from None
        streams = {colocated_engine_rank(rank, receiver.tp): stream}
    elif rank != 0:
        if result:
            raise DistributedExportError(f"{source}: distributed delivery sends from trainer "
                                         f"rank 0 only; rank {rank} returned "
                                         f"{type(result).__name__} (expected None)")
        return {}
    else:
        if not isinstance(result, Mapping):
            raise DistributedExportError(f"{source}: distributed delivery returns "
                                         f"{{engine_rank: stream}} from rank 0, got "
                                         f"{type(result).__name__}")
        wanted = set(range(receiver.tp))
        if set(result) != wanted:
            raise DistributedExportError(f"{source}: streams for engine ranks {sorted(result)}, "
                                         f"expected every engine rank {sorted(wanted)}")
        try:
            streams = {int(k): as_stream(v, source=f"{source} (engine rank {k})")
                       for k, v in result.items()}
        except TypeError as error:
            raise DistributedExportError(str(error)) from None
    for engine_rank, stream in streams.items():
        check_tensors(stream, f"{source} (engine rank {engine_rank})")
        check_bucket_limit(stream, bucket_bytes, f"{source} (engine rank {engine_rank})")
    return {k: _copied(v) for k, v in streams.items()}


def call_exporter(exporter, model_state: Mapping, *, config, format: str, spec, trainer,
                  receiver, delivery: str, bucket_bytes: Optional[int], rank: int,
                  update: int) -> RankExport:
    """One update: call ``exporter.export_weights_distributed`` in this rank, check that it
    left ``model_state`` alone, and return its streams. Collective (every rank calls it)."""
    call = f"export call for update {update} ({format}, {delivery} delivery) in trainer rank {rank}"
    before = snapshot(model_state)
    result = exporter.export_weights_distributed(
        model_state, config=config, format=format, spec=spec, trainer=trainer,
        receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
    check_inputs_unchanged(before, model_state, call=call, owner=f"trainer rank {rank}")
    streams = normalize_result(result, delivery=delivery, rank=rank, receiver=receiver,
                               bucket_bytes=bucket_bytes, source=f"{exporter.name}: {call}")
    return RankExport(rank, streams)
