"""The engine side of SGLang's distributed update path, for a distributed exporter to send to.

SGLang's ``update_weights_from_distributed(names, dtypes, shapes, group_name, load_format)``
(``WeightUpdater.receive_weights_from_distributed`` in 0.5.23) is metadata first, tensors
after: every engine TP rank allocates ``torch.empty(shape, dtype)`` for each announced tensor
and joins a broadcast from rank 0 of the weights-update group, in the announced order (with
``load_format="flattened_bucket"``: ONE uint8 buffer, the tensors packed densely in the
announced order, each offset a multiple of its item size or the engine refuses it -
``FlattenedTensorBucket.empty``). The sender is the trainer (slime's distributed path, verl's
NCCL sync, NeMo-RL); an order, dtype or shape that disagrees with what it broadcasts lands the
wrong bytes, or none.

:class:`BroadcastEngine` plays those engine ranks inside the sending trainer rank's process:
one thread per engine TP rank, a real gloo group of ``1 + engine_tp`` ranks (the sender is
rank 0), created when the exporter first asks for :attr:`BroadcastEngine.group`. The
exporter calls :meth:`BroadcastEngine.update_weights_from_distributed` (it returns at once,
as a Ray ``.remote`` call does), then ``torch.distributed.broadcast(tensor, src=0,
group=engine.group)`` for each tensor; :meth:`BroadcastEngine.finish` collects what every
engine rank received, one bucket per call, as the stream the harness judges. Every receive
times out (:data:`TIMEOUT_S`), and :meth:`BroadcastEngine.close` leaves no thread, socket or
registered group behind.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Optional, Sequence

from pytest_weightsync.wire import WireFormatError, entry_bytes

#: Seconds an engine rank waits for a broadcast the sender announced (and a sender for one
#: nobody announced) before the update fails.
TIMEOUT_S = 30.0
#: ``load_format`` values of the distributed path.
LOAD_FORMATS = (None, "flattened_bucket")
_GROUP_IDS = itertools.count()


class BroadcastError(AssertionError):
    """The sender's broadcasts disagree with what it announced (count, dtype, shape), or it
    announced what the engine refuses. The message names the call and the engine rank."""


def _dtype(value):
    import torch

    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype):
        raise WireFormatError(f"dtype {value!r} is neither a torch.dtype nor a torch dtype name")
    return found


def announced(names, dtypes, shapes) -> list:
    """``[(name, dtype, shape)]`` of one announcement, or :class:`WireFormatError` naming
    what an engine cannot allocate (lists of different lengths, a negative size)."""
    names, dtypes, shapes = list(names), list(dtypes), list(shapes)
    if not len(names) == len(dtypes) == len(shapes):
        raise WireFormatError(f"announced {len(names)} names, {len(dtypes)} dtypes and "
                              f"{len(shapes)} shapes; an engine zips them")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise WireFormatError(f"{name!r:.120}: negative size in shape {shape}")
        out.append((name, _dtype(dtype), shape))
    return out


def dense_offsets(entries) -> list:
    """Byte offsets of ``entries`` (``(name, dtype, shape)``) packed densely in order, as the
    engine computes them for a flattened broadcast; :class:`WireFormatError` for an offset
    that is not a multiple of the entry's item size (the engine refuses the bucket)."""
    offsets, offset = [], 0
    for name, dtype, shape in entries:
        if offset % dtype.itemsize:
            raise WireFormatError(f"{name!r:.120}: byte offset {offset} of a densely packed "
                                  f"flattened broadcast is not a multiple of the {dtype} item "
                                  f"size {dtype.itemsize}; SGLang refuses the bucket "
                                  f"(FlattenedTensorBucket.empty): order the entries by item "
                                  f"size or send them apart (verl#7318)")
        offsets.append(offset)
        offset += entry_bytes(dtype, shape)
    return offsets + [offset]


class _EngineRank(threading.Thread):
    """One engine TP rank: joins the group, then receives every announced call in order."""

    def __init__(self, rank: int, make_group):
        super().__init__(name=f"weightsync-engine-rank-{rank}", daemon=True)
        self.rank = rank
        self.make_group = make_group
        self.calls: "queue.Queue" = queue.Queue()
        self.joined = threading.Event()
        self.group = None
        self.stream: list = []
        self.error: Optional[str] = None

    def run(self) -> None:
        try:
            self.group = self.make_group(1 + self.rank)
        except Exception as error:
            self.error = f"could not join the weights-update group: {error}"
            return
        finally:
            self.joined.set()
        while True:
            call = self.calls.get()
            if call is None:
                return
            index, entries, load_format = call
            try:
                self.stream.append(self._receive(entries, load_format))
            except Exception as error:  # a timeout, a size the sender did not send
                self.error = (f"call {index}: the broadcast of {len(entries)} announced "
                              f"tensor(s) failed: {type(error).__name__}: {str(error)[:300]}")
                return

    def _receive(self, entries, load_format) -> list:
        import torch
        import torch.distributed as dist

        def broadcast(tensor):
            return self.group.broadcast([tensor], dist.BroadcastOptions())

        if load_format == "flattened_bucket":
            offsets = dense_offsets(entries)
            flat = torch.empty(offsets[-1], dtype=torch.uint8)
            broadcast(flat).wait()
            return [(name, flat[offsets[i]:offsets[i + 1]].view(dtype).reshape(shape))
                    for i, (name, dtype, shape) in enumerate(entries)]
        received = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in entries]
        handles = [broadcast(tensor) for _, tensor in received]
        for handle in handles:
            handle.wait()
        return received


class BroadcastEngine:
    """The ``engine_tp`` ranks of an engine receiving broadcasts from this process (see the
    module docstring). Use it once: announce, broadcast, :meth:`finish`, :meth:`close`."""

    def __init__(self, engine_tp: int, *, timeout: float = TIMEOUT_S):
        self.engine_tp = engine_tp
        self.timeout = timeout
        self.calls = 0
        self._group = None
        self._ranks: list = []

    @property
    def used(self) -> bool:
        """Whether the exporter asked for the group or announced anything."""
        return self._group is not None or self.calls > 0

    @property
    def group(self):
        """The weights-update group (``torch.distributed`` gloo, rank 0 = this sender, ranks
        1..``engine_tp`` = the engine's TP ranks), created on first use."""
        if self._group is None:
            self._join()
        return self._group

    def _join(self) -> None:
        import datetime

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        store = dist.PrefixStore(f"weightsync-update-group-{next(_GROUP_IDS)}/", dist.HashStore())
        size = 1 + self.engine_tp
        timeout = datetime.timedelta(seconds=self.timeout)

        def make_group(rank):
            return dist.ProcessGroupGloo(store, rank, size, timeout)

        self._ranks = [_EngineRank(r, make_group) for r in range(self.engine_tp)]
        for thread in self._ranks:
            thread.start()
        group = make_group(0)
        for thread in self._ranks:
            thread.joined.wait(self.timeout)
        # Registered as torch.distributed.new_group registers a group, so that
        # dist.broadcast(tensor, src=0, group=engine.group) works (SGLang's
        # init_custom_process_group does the same): group ranks are their own global ranks.
        c10d._world.pg_group_ranks[group] = {r: r for r in range(size)}
        self._group = group

    def init_weights_update_group(self, *args, **kwargs):
        """SGLang's name for joining the group; here the group exists already (:attr:`group`)."""
        return self.group

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence,
                                        shapes: Sequence, *, load_format: Optional[str] = None,
                                        **_ignored) -> None:
        """Announce one bucket: every engine rank allocates it and joins the broadcasts that
        follow (one per tensor, or one flat uint8 buffer with ``load_format=
        "flattened_bucket"``). Returns at once; extra keywords (``group_name``,
        ``flush_cache``, ``weight_version``) are accepted and ignored."""
        if load_format not in LOAD_FORMATS:
            raise WireFormatError(f"load_format {load_format!r}; the distributed path takes "
                                  f"{LOAD_FORMATS}")
        entries = announced(names, dtypes, shapes)
        if load_format == "flattened_bucket":
            dense_offsets(entries)  # refused here, before anything is broadcast
        self.group  # noqa: B018 - the engine ranks must be in the group before the broadcasts
        self.calls += 1
        for thread in self._ranks:
            thread.calls.put((self.calls, entries, load_format))

    def finish(self) -> dict:
        """``{engine_rank: stream}``: what every engine rank received, one bucket per call, or
        :class:`BroadcastError` naming the first call an engine rank could not receive."""
        for thread in self._ranks:
            thread.calls.put(None)
        for thread in self._ranks:
            thread.join(self.timeout + 5)
        for thread in self._ranks:
            if thread.is_alive():
                raise BroadcastError(f"engine rank {thread.rank}: still waiting for a "
                                     f"broadcast {self.timeout + 5:.0f} s after the exporter "
                                     f"returned")
            if thread.error is not None:
                raise BroadcastError(f"engine rank {thread.rank}: {thread.error} (the sender's "
                                     f"broadcasts must follow its announcements: one per "
                                     f"announced tensor, in order, of the announced dtype and "
                                     f"shape)")
        return {thread.rank: thread.stream for thread in self._ranks}

    def close(self) -> None:
        """Stop the engine ranks and unregister and drop the group (idempotent)."""
        from torch.distributed import distributed_c10d as c10d

        for thread in self._ranks:
            thread.calls.put(None)
        for thread in self._ranks:
            thread.join(self.timeout + 5)
        if self._group is not None:
            c10d._world.pg_group_ranks.pop(self._group, None)
        for thread in self._ranks:
            thread.group = None
        self._group = None
        self._ranks = []
