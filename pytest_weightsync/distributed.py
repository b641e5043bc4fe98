"""Calling a distributed exporter inside a trainer rank, and checking what it did there.

A distributed exporter (``export_weights_distributed``, see :mod:`pytest_weightsync.protocols`)
runs in every rank of a real ``torch.distributed`` job and does its own collectives, so the
harness cannot look over its shoulder from one process. This module is the part of the
harness that runs in each rank: it calls the exporter once per update, then checks right
there, before anything is pickled back, that

* the call left every trainer parameter bit-identical (an exporter that regroups fc1 in place
  corrupts the next training step; the message names the call, the rank, the parameter and the
  first changed row/col);
* the call left every parameter where it was: the same ``nn.Parameter`` objects in the model,
  each on the same storage (data pointer, strides, offset, base buffer) - an exporter that
  rebinds ``param.data`` (offload/onload done wrong) leaves the optimizer updating storage the
  model no longer uses; the message names it "rebound";
* the result has the shape the delivery mode promises (a stream per colocated rank; a
  ``{engine_rank: stream}`` map from rank 0 and nothing from the others);
* every entry carries a plain tensor (a lock, a list or a DTensor is named by bucket and
  entry, not met later as an ``AttributeError`` of a copy);
* every bucket sent on a wire format (a flattened bucket, a serialized update:
  :mod:`pytest_weightsync.wire`) decodes, with the harness's own decoder, into what the engine
  rank it was sent to reads - an offset, size or dtype-grouping bug of the encoder is named
  here, by bucket and entry. Broadcasts (:mod:`pytest_weightsync.transports.broadcast`) are received by
  engine ranks played in the sender's process, and what they received is the stream.

The bucket limit is judged apart, in the pytest process, from the streams that come back
(:func:`pytest_weightsync.reference_impl.senders.buckets.bucket_limit_findings`): a finding, never a
value failure.

Tensors are copied out of the exporter's buffers before they travel (a view would pickle its
whole storage). Nothing here knows the reference implementation: the values are judged in the
pytest process, by the suite, against an independent oracle. torch is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from pytest_weightsync.protocols import DELIVERIES, as_stream, colocated_engine_rank
from pytest_weightsync.ranks.hygiene import harness_sockets
from pytest_weightsync import transports
from pytest_weightsync.transports.base import WireFormatError


class DistributedExportError(AssertionError):
    """A distributed exporter broke its contract in a rank (modified its inputs, returned the
    wrong shape of result, overfilled a bucket). The message names the call and the rank."""


@dataclass
class RankExport:
    """What one trainer rank's exporter call produced: ``streams`` maps an engine rank to the
    bucket stream this trainer rank sent it (empty for a non-sender in distributed mode),
    ``transports`` the wire formats its buckets travelled on."""

    trainer_rank: int
    streams: dict
    transports: frozenset = frozenset()

    def __repr__(self) -> str:  # the streams hold the buckets' tensors: counted, never shown
        buckets = {engine: len(stream) if hasattr(stream, "__len__") else "?"
                   for engine, stream in self.streams.items()}
        return (f"RankExport(trainer_rank={self.trainer_rank}, buckets per engine rank "
                f"{buckets}, transports={sorted(self.transports)})")


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


def storage_snapshot(named: Mapping) -> dict:
    """Where each tensor of ``named`` lives: ``{name: (object id, data pointer, strides,
    storage offset, base buffer pointer)}`` (the base is that of ``.data``: a parameter in a
    DDP / distributed-optimizer buffer is a view of it)."""
    out = {}
    for name, tensor in named.items():
        data = tensor.data if hasattr(tensor, "data") else tensor
        base = getattr(data, "_base", None)
        out[name] = (id(tensor), tensor.data_ptr(), tuple(tensor.stride()),
                     tensor.storage_offset(), None if base is None else base.data_ptr())
    return out


def first_rebinding(before: Mapping, model_state: Mapping, model=None) -> Optional[str]:
    """What changed place since ``before`` (a :func:`storage_snapshot` of ``model_state``):
    ``"NAME: ..."`` for the first parameter that is no longer the same object in ``model``
    (when given: a list of model chunks) or no longer on the same storage, else ``None``."""
    if model is not None:
        now = {}
        for chunk in model:
            now.update(chunk.named_parameters())
        for name, tensor in model_state.items():
            if name in now and now[name] is not tensor:
                return (f"{name}: the model now holds another Parameter object under this name "
                        f"(the module attribute was replaced)")
    fields = ("object", "data_ptr", "strides", "storage offset", "base buffer")
    for name, tensor in model_state.items():
        old = before.get(name)
        if old is None:
            continue
        new = storage_snapshot({name: tensor})[name]
        for what, a, b in zip(fields, old, new):
            if a == b:
                continue
            if what == "object":
                return (f"{name}: the state now holds another object under this name (the "
                        f"parameter was replaced)")
            shown = (hex(a), hex(b)) if what in ("data_ptr", "base buffer") and \
                None not in (a, b) else (a, b)
            return (f"{name}: {what} {shown[0]} -> {shown[1]} (param.data reassigned: the "
                    f"optimizer and the model no longer share this storage)")
    return None


def check_storage_unchanged(before: Mapping, model_state: Mapping, model=None, *, call: str,
                            owner: str) -> None:
    """Raise :class:`DistributedExportError` naming the pattern "rebound" when ``call`` moved
    one of ``owner``'s parameters to other storage or replaced it in the model."""
    where = first_rebinding(before, model_state, model)
    if where is not None:
        raise DistributedExportError(f"{call} rebound {owner}'s parameter {where}")


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


def _items(result):
    """``result`` as a list of buckets (one bucket alone becomes a list of one), or as it is
    when it is no stream at all (left for :func:`~pytest_weightsync.protocols.as_stream`)."""
    if result is None or isinstance(result, (str, bytes)) or \
            transports.of(result).name != transports.FALLBACK:
        return None if result is None else [result]
    return list(result) if hasattr(result, "__iter__") else result


def _release(items, entries=None) -> None:
    """What no engine rank will read now of ``items`` (a stream, or anything else), let go by
    its transport (:meth:`~pytest_weightsync.transports.base.Transport.release`)."""
    for item in items if isinstance(items, list) else ():
        transport = transports.of(item)
        if transport.replica_wide:
            transport.release(item, entries)


def decoded_stream(result, *, engine_rank: int, engine_tp: int, source: str,
                   transports_met: set, drain: bool = True) -> object:
    """``result`` (a stream, or one bucket) with every wire-format bucket decoded into the
    ``(name, tensor)`` pairs engine rank ``engine_rank`` reads, each by its transport
    (:mod:`pytest_weightsync.transports`); the transports met are added to ``transports_met``.
    Anything else is left for :func:`pytest_weightsync.protocols.as_stream` to judge. With
    ``drain`` (the default) the other engine ranks' entries of a replica-wide bucket are read
    too, and dropped: nobody else will read them."""
    items = _items(result)
    if not isinstance(items, list):
        return items
    whole = next((t for t in map(transports.of, items) if t.whole_stream), None)
    if whole is not None:  # a session of calls, decoded and checked before any bucket
        try:
            out = whole.decode_stream(items, engine_rank=engine_rank, engine_tp=engine_tp,
                                      where=source)
        except _refusals(whole) as error:
            raise DistributedExportError(str(error)) from None
        transports_met.add(whole.name)
        return out
    out = []
    for index, bucket in enumerate(items):
        transport = transports.of(bucket)
        if transport.name == transports.FALLBACK:
            out.append(bucket)
            continue
        where = f"{source}: bucket {index} ({transport.name})"
        try:
            with harness_sockets():
                pairs = transport.decode(bucket, engine_rank=engine_rank, engine_tp=engine_tp,
                                         where=where)
                for k in range(engine_tp) if drain and transport.replica_wide else ():
                    if k != engine_rank:  # read and dropped: nobody else will fetch them
                        transport.decode(bucket, engine_rank=k, engine_tp=engine_tp,
                                         where=where)
        except _refusals(transport) as error:
            entries = None if drain else [engine_rank]
            _release(items[index:], entries)  # no engine rank reads the rest of it now
            raise DistributedExportError(str(error)) from None
        transports_met.add(transport.name)
        out.append(list(pairs))
    return out


def _refusals(transport) -> tuple:
    """What ``transport``'s decoder raises for a bucket an engine would refuse."""
    return (WireFormatError, *transport.errors)


def _identities(result) -> dict:
    """``{bucket index: identity}`` of the replica-wide buckets in ``result``: what identifies
    one update returned by several ranks (:meth:`~pytest_weightsync.transports.base.Transport.identity`;
    ``None``: this rank's alone)."""
    items = _items(result)
    if not isinstance(items, list):
        return {}
    out = {}
    for index, bucket in enumerate(items):
        transport = transports.of(bucket)
        if transport.replica_wide:
            out[index] = transport.identity(bucket)
    return out


def serialized_readers(result, *, rank: int, engine_tp: int) -> dict:
    """``{bucket index: engine ranks}``: which entries of each replica-wide bucket (a serialized
    update) in this colocated trainer rank's ``result`` this rank reads. Collective over the
    default process group (every rank calls it once per export call, whatever its exporter
    returned).

    A serialized update reaches every engine TP rank of its replica, each reading its own entry
    (SGLang's TP workers). Trainer rank ``k`` plays engine rank ``k % tp``: where the replica's
    ranks return the same update (a gather source whose serialized calls go to every rank of its
    group, as slime's and verl's colocated paths do), rank ``k`` reads entry ``k % tp`` - in
    another process than the one that serialized it, as in the real flow; an entry whose own
    rank did not return the update is read by the first rank that did. So every entry is read
    exactly once in the replica (a descriptor can be fetched once)."""
    digests = _identities(result)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        everyone, world = [list(digests.values())], 1
    else:
        world = dist.get_world_size()
        everyone = [None] * world
        dist.all_gather_object(everyone, list(digests.values()))
    base = rank - rank % engine_tp
    members = [r for r in range(base, base + engine_tp) if r < world or r == rank]
    out = {}
    for index, digest in digests.items():
        holders = [rank] if digest is None else \
            [r for r in members if digest in (everyone[r] if r < len(everyone) else ())]
        if rank not in holders:
            holders.append(rank)
        out[index] = {k for k in range(engine_tp)
                      if (base + k if base + k in holders else min(holders)) == rank}
    return out


def _colocated_streams(result, *, own: int, engine_tp: int, source: str,
                       transports_met: set, readers: Optional[dict] = None) -> dict:
    """``{engine rank: stream}`` of one colocated trainer rank's ``result``: its pairs and
    flattened buckets (and vLLM's calls) reach ``own``, its colocated engine rank; a
    replica-wide bucket (a serialized update) reaches every engine TP rank of its replica, each
    reading its own entry, as SGLang's TP workers do: this rank reads the entries ``readers``
    gives it (:func:`serialized_readers`; default every entry). ``None`` or an empty result is
    nothing from this rank: an empty stream for ``own``, judged with what the other ranks sent
    it."""
    if result is None or (isinstance(result, (list, tuple)) and not result):
        return {own: []}
    items = _items(result)
    wide = isinstance(items, list) and any(transports.of(b).replica_wide for b in items)
    if not wide:
        result = decoded_stream(result, engine_rank=own, engine_tp=engine_tp, source=source,
                                transports_met=transports_met)
        try:
            return {own: as_stream(result, source=source)}
        except TypeError as error:
            raise DistributedExportError(
                f"{error} (colocated delivery: a trainer rank returns the stream of its "
                f"colocated engine rank, serialized updates for its replica's engine ranks, or "
                f"nothing)") from None
    every = set(range(engine_tp))
    kept: dict = {}
    for index, bucket in enumerate(items):
        transport = transports.of(bucket)
        if not transport.replica_wide:  # pairs and flattened buckets reach the own engine rank
            kept.setdefault(own, []).extend(decoded_stream(
                [bucket], engine_rank=own, engine_tp=engine_tp, source=source,
                transports_met=transports_met))
            continue
        where = f"{source}: bucket {index} ({transport.name})"
        mine = sorted(every if readers is None else readers.get(index, ()))
        for engine_rank in mine:
            try:
                with harness_sockets():
                    pairs = transport.decode(bucket, engine_rank=engine_rank,
                                             engine_tp=engine_tp, where=where)
            except _refusals(transport) as error:
                transport.release(bucket, mine)
                raise DistributedExportError(str(error)) from None
            transports_met.add(transport.name)
            if pairs or engine_rank == own:
                kept.setdefault(engine_rank, []).append(list(pairs))
    kept.setdefault(own, [])
    streams = {}
    for engine_rank, stream in sorted(kept.items()):
        try:
            streams[engine_rank] = as_stream(stream, source=source)
        except TypeError as error:
            raise DistributedExportError(str(error)) from None
    return streams


def normalize_result(result, *, delivery: str, rank: int, receiver, source: str,
                     transports_met: set = None, readers: Optional[dict] = None) -> dict:
    """The exporter's ``result`` in trainer rank ``rank`` as ``{engine_rank: stream}``
    (wire buckets decoded, tensors copied), or :class:`DistributedExportError` naming what is
    wrong with it. The wire formats met are added to ``transports_met``; ``readers``: which
    entries of each serialized update this rank reads under colocated delivery
    (:func:`serialized_readers`; default every entry)."""
    transports_met = set() if transports_met is None else transports_met
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery must be one of {DELIVERIES}, got {delivery!r}")
    if delivery == "colocated":
        streams = _colocated_streams(result, own=colocated_engine_rank(rank, receiver.tp),
                                     engine_tp=receiver.tp, source=source,
                                     transports_met=transports_met, readers=readers)
    elif rank != 0:
        if result:
            raise DistributedExportError(f"{source}: distributed delivery returns streams from "
                                         f"trainer rank 0 only (the other ranks broadcast over "
                                         f"their engine channel, or send nothing); rank {rank} "
                                         f"returned {type(result).__name__} (expected None)")
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
        streams, pending = {}, list(result.items())
        try:
            while pending:
                k, v = pending.pop(0)
                streams[int(k)] = as_stream(decoded_stream(
                    v, engine_rank=int(k), engine_tp=receiver.tp, source=f"{source} (engine "
                    f"rank {k})", transports_met=transports_met), source=f"{source} (engine rank {k})")
        except (TypeError, DistributedExportError) as error:
            for _, rest in pending:  # what no engine rank will read now: released
                _release(_items(rest))
            raise DistributedExportError(str(error)) from None
    for engine_rank, stream in streams.items():
        check_tensors(stream, f"{source} (engine rank {engine_rank})")
    return {k: _copied(v) for k, v in streams.items()}


def _channel_streams(channel_transport, channel, result, *, source: str) -> dict:
    """The streams the engine ranks of ``channel`` received (the exporter sent on the channel
    transport - a broadcast - instead of returning streams), or :class:`DistributedExportError`
    naming what went wrong."""
    if result:
        raise DistributedExportError(f"{source}: it sent on the engine channel "
                                     f"({channel_transport.name}) AND returned "
                                     f"{type(result).__name__}; a sender does one of the two")
    try:
        streams = channel_transport.received(channel)
    except _refusals(channel_transport) as error:
        raise DistributedExportError(f"{source}: {error}") from None
    return {k: _copied(v) for k, v in streams.items()}


def call_exporter(exporter, model_state: Mapping, *, config, format: str, spec, trainer,
                  receiver, delivery: str, bucket_bytes: Optional[int], rank: int,
                  update: int, model=None, source_rank: Optional[bool] = None,
                  settled: Optional[dict] = None) -> RankExport:
    """One update: call ``exporter.export_weights_distributed`` in this rank (``model``, the
    list of model chunks, reaches exporters that take the optional keyword; so does
    ``engine``, a :class:`pytest_weightsync.transports.broadcast.BroadcastEngine` in every source rank of
    distributed delivery - ``source_rank``: the first rank of a pipeline stage, default
    trainer rank 0 only - and ``None`` elsewhere), check that it left ``model_state`` alone -
    values and storage - and return its streams. Collective (every rank calls it).

    ``settled``: a :func:`snapshot` of ``model_state`` as the trainer's own deferred work
    would leave it (the param all-gather a distributed-optimizer step defers to the next
    forward): an exporter that completes that work has not modified its inputs."""
    from pytest_weightsync.protocols import SIGNATURES, accepts_keyword

    call = f"export call for update {update} ({format}, {delivery} delivery) in trainer rank {rank}"
    owner = f"trainer rank {rank}"
    source = f"{exporter.name}: {call}"
    before = snapshot(model_state)
    placed = storage_snapshot(model_state)
    kwargs = dict(config=config, format=format, spec=spec, trainer=trainer, receiver=receiver,
                  delivery=delivery, bucket_bytes=bucket_bytes)
    method = exporter.export_weights_distributed
    optional = SIGNATURES["export_weights_distributed"][2]
    if model is not None and "model" in optional and accepts_keyword(method, "model"):
        kwargs["model"] = model
    engine, channel_transport = None, transports.get("broadcast")
    if accepts_keyword(method, "engine"):
        sends = rank == 0 if source_rank is None else source_rank
        engine = channel_transport.open_channel(receiver.tp) \
            if delivery == "distributed" and sends else None
        kwargs["engine"] = engine
    transports_met: set = set()
    try:
        failed = None
        try:
            result = method(model_state, **kwargs)
        except BaseException as error:  # every rank must still reach the readers' exchange
            failed, result = error, None
        readers = serialized_readers(result, rank=rank, engine_tp=receiver.tp) \
            if delivery == "colocated" else None
        if failed is not None:
            raise failed
        check_storage_unchanged(placed, model_state, model, call=call, owner=owner)
        if settled is None or first_modification(settled, model_state) is not None:
            check_inputs_unchanged(before, model_state, call=call, owner=owner)
        if engine is not None and engine.used:
            streams = _channel_streams(channel_transport, engine, result, source=source)
            transports_met.add(channel_transport.name)
        else:
            streams = normalize_result(result, delivery=delivery, rank=rank, receiver=receiver,
                                       source=source, transports_met=transports_met,
                                       readers=readers)
    finally:
        if engine is not None:
            engine.close()
    return RankExport(rank, streams, frozenset(transports_met))
