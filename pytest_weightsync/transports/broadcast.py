"""``broadcast``: SGLang's distributed update path, both ends (a channel, not a bucket).

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

The sender's end of the group checks every broadcast against what was announced before the
collective runs (:class:`BroadcastMismatchError`, naming the announced and the sent dtype,
shape and bytes). Gloo cannot be trusted with a mismatch: a broadcast longer than the
receivers' buffers (a float32 tensor where bfloat16 was announced) fails an enforce inside an
engine thread and aborts the whole process, trainer rank included; a shorter one completes
and leaves the tail of the buffer with whatever it held; a non-contiguous tensor is sent as its
storage in memory order. A refused broadcast is not sent: the engine ranks are given zeros of
exactly what they were announced so that none is left waiting, the rest of the exporter's
broadcasts on the group return at once without sending, and :meth:`BroadcastEngine.finish`
raises the refusal instead of returning streams. Broadcasts announced and never sent (an
exporter that returned early, or raised, or a dtype gloo itself raises on in the sender) are
given to the engine ranks the same way when the update ends, so no thread waits out its
timeout.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from typing import NamedTuple, Optional, Sequence

from pytest_weightsync.transports.base import Transport, WireFormatError
from pytest_weightsync.transports.shapes import checked_shape, entry_bytes, tensor_bytes

__all__ = [
    "Broadcast", "BroadcastEngine", "BroadcastError", "BroadcastMismatchError", "LOAD_FORMATS",
    "TIMEOUT_S", "TRANSPORT", "announced", "dense_offsets", "send",
]

#: Seconds an engine rank waits for a broadcast the sender announced before the update fails
#: (one nobody announced is refused in the sender at once).
TIMEOUT_S = 30.0
#: ``load_format`` values of the distributed path.
LOAD_FORMATS = (None, "flattened_bucket")
_GROUP_IDS = itertools.count()


class BroadcastError(AssertionError):
    """The sender's broadcasts disagree with what it announced (count, dtype, shape), or it
    announced what the engine refuses. The message names the call and the engine rank."""


class BroadcastMismatchError(BroadcastError):
    """A broadcast refused in the sender before the collective ran: of another dtype or size
    than the announced tensor it stands for, none announced, not one dense contiguous tensor,
    or not from rank 0. The message names the call, the tensor, and the announced and the sent
    dtype, shape and bytes."""


class _Expected(NamedTuple):
    """One broadcast the engine ranks wait for: of ``call``, the ``index``-th of ``count``,
    ``what`` it carries, the ``dtype`` and ``shape`` they allocated."""

    call: int
    index: int
    count: int
    what: str
    dtype: object
    shape: tuple

    @property
    def nbytes(self) -> int:
        return entry_bytes(self.dtype, self.shape)


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
        out.append((name, _dtype(dtype), checked_shape(shape, f"{name!r:.120}")))
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


_CLASSES: dict = {}


def _sender_group_class():
    """``ProcessGroupGloo`` whose :meth:`broadcast` first asks its engine whether the tensor is
    the one the engine ranks wait for (both ``dist.broadcast`` and a direct
    ``group.broadcast`` reach it; the engine ranks' own ends stay plain gloo)."""
    if "group" not in _CLASSES:
        import torch.distributed as dist

        class SenderGroup(dist.ProcessGroupGloo):
            engine = None

            def broadcast(self, *args, **kwargs):
                engine = self.engine
                send = super().broadcast
                if engine is None:
                    return send(*args, **kwargs)
                return engine._sender_broadcast(send, args, kwargs)

        _CLASSES["group"] = SenderGroup
    return _CLASSES["group"]


def _done_work():
    """A completed ``Work``: what a broadcast the engine did not send returns, so that
    ``dist.broadcast`` (which waits on it) and ``async_op`` callers go on at once."""
    if "work" not in _CLASSES:
        import torch
        import torch.distributed as dist

        class Done(dist.Work):
            def wait(self, timeout=None):
                return True

            def is_completed(self):
                return True

            def is_success(self):
                return True

            def get_future(self):
                future = torch.futures.Future()
                future.set_result([])
                return future

        _CLASSES["work"] = Done
    return _CLASSES["work"]()


def _broadcast_args(args, kwargs):
    """``(tensors, root)`` of a ``ProcessGroup.broadcast`` call in either of its forms
    (``(tensors, opts)`` or ``(tensor, root)``); ``None`` when neither."""
    import torch

    first = args[0] if args else kwargs.get("tensors", kwargs.get("tensor"))
    rest = args[1] if len(args) > 1 else kwargs.get("opts", kwargs.get("root"))
    if isinstance(first, torch.Tensor):
        return [first], rest if isinstance(rest, int) else 0
    if not isinstance(first, (list, tuple)):
        return None
    return list(first), getattr(rest, "rootRank", 0) if rest is not None else 0


def _reads_as(sent, announced) -> bool:
    """Whether a tensor of dtype ``sent`` carries bytes of ``announced`` as torch's own
    ``dist.broadcast`` passes them on: the dtype itself, the real view of a complex dtype, the
    uint8 view of an FP8 dtype."""
    import torch

    if sent == announced:
        return True
    if announced.is_complex:
        return sent == announced.to_real()
    return sent == torch.uint8 and announced.is_floating_point and announced.itemsize == 1


def _described(dtype, shape) -> str:
    return f"{dtype} {tuple(shape)}, {entry_bytes(dtype, shape)} bytes"


class BroadcastEngine:
    """The ``engine_tp`` ranks of an engine receiving broadcasts from this process (see the
    module docstring). Use it once: announce, broadcast, :meth:`finish`, :meth:`close`."""

    def __init__(self, engine_tp: int, *, timeout: float = TIMEOUT_S):
        self.engine_tp = engine_tp
        self.timeout = timeout
        self.calls = 0
        self._group = None
        self._ranks: list = []
        #: Broadcasts announced and not yet sent, in the order the engine ranks receive them.
        self._expected: "collections.deque[_Expected]" = collections.deque()
        #: The first broadcast refused in the sender (its message); nothing is sent after it.
        self._refusal: Optional[str] = None

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
        group = _sender_group_class()(store, 0, size, timeout)
        group.engine = self
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
        ``flush_cache``, ``weight_version``) are accepted and ignored. After a refused
        broadcast an announcement is counted and nothing more (no engine rank listens)."""
        import torch

        if load_format not in LOAD_FORMATS:
            raise WireFormatError(f"load_format {load_format!r}; the distributed path takes "
                                  f"{LOAD_FORMATS}")
        entries = announced(names, dtypes, shapes)
        if load_format == "flattened_bucket":
            offsets = dense_offsets(entries)  # refused here, before anything is broadcast
        self.group  # noqa: B018 - the engine ranks must be in the group before the broadcasts
        self.calls += 1
        if self._refusal is not None:
            return
        if load_format == "flattened_bucket":
            first = f", first {entries[0][0]!r:.120}" if entries else ""
            what = f"the flattened buffer of {len(entries)} announced tensor(s){first}"
            self._expected.append(_Expected(self.calls, 0, 1, what, torch.uint8,
                                            (offsets[-1],)))
        else:
            self._expected.extend(_Expected(self.calls, i, len(entries), f"{name!r:.120}",
                                            dtype, shape)
                                  for i, (name, dtype, shape) in enumerate(entries))
        for thread in self._ranks:
            thread.calls.put((self.calls, entries, load_format))

    # -- the sender's end of the group ---------------------------------------------------------

    def _sender_broadcast(self, send, args, kwargs):
        """A broadcast the exporter makes on :attr:`group`: sent when it is the next one the
        engine ranks wait for, else refused (see the module docstring) and not sent."""
        if self._refusal is not None:
            return _done_work()
        parsed = _broadcast_args(args, kwargs)
        if parsed is None:
            return send(*args, **kwargs)
        problem = self._mismatch(*parsed)
        if problem is None:
            work = send(*args, **kwargs)  # where gloo raises, the engine ranks still wait for it
            self._expected.popleft()
            return work
        self._refusal = problem
        self._drain(send)
        return _done_work()

    def _mismatch(self, tensors, root) -> Optional[str]:
        """Why the broadcast of ``tensors`` from ``root`` is not the next announced one."""
        import torch

        tail = "; refused before the collective ran"
        if root != 0:
            return (f"a broadcast from group rank {root}: the sender is rank 0 of the "
                    f"weights-update group, the engine ranks only receive{tail}")
        if len(tensors) != 1:
            return (f"a broadcast of {len(tensors)} tensors in one call; the engine ranks "
                    f"receive one tensor per broadcast{tail}")
        tensor = tensors[0]
        if not self._expected:
            sent = (_described(tensor.dtype, tensor.shape) if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__)
            return (f"a broadcast ({sent}) after call {self.calls}, with no announced tensor "
                    f"left for the engine ranks to receive: announce every broadcast first "
                    f"(update_weights_from_distributed){tail}")
        want = self._expected[0]
        head = (f"call {want.call}, broadcast {want.index + 1} of {want.count} ({want.what}): "
                f"announced {_described(want.dtype, want.shape)}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            kind = (f"a {tensor.layout} tensor" if isinstance(tensor, torch.Tensor)
                    else f"a {type(tensor).__name__}")
            return f"{head}, sent {kind}; a broadcast carries one dense tensor{tail}"
        sent = _described(tensor.dtype, tensor.shape)
        if not tensor.is_contiguous():
            return (f"{head}, sent a non-contiguous {sent} (strides {tensor.stride()}); NCCL "
                    f"refuses it and gloo sends its storage in memory order, not its "
                    f"elements{tail}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > want.nbytes:
            why = ("longer than announced: the engine ranks receive into buffers of the "
                   "announced size (gloo aborts the process, NCCL writes past them)")
        elif nbytes < want.nbytes:
            why = (f"shorter than announced: the engine ranks' buffers would keep their old "
                   f"bytes after byte {nbytes}")
        elif not _reads_as(tensor.dtype, want.dtype):
            why = (f"{tensor.dtype} where {want.dtype} was announced: the engine ranks read "
                   f"its bytes as {want.dtype}")
        else:
            return None
        return f"{head}, sent {sent}: {why}{tail}"

    def _drain(self, send) -> None:
        """Give every engine rank each broadcast it still waits for (zeros of the announced
        size), so that none is left waiting after a refusal or an abandoned call."""
        import torch
        import torch.distributed as dist

        while self._expected:
            want = self._expected.popleft()
            options = dist.BroadcastOptions()
            options.rootRank = 0
            try:
                send([torch.zeros(want.nbytes, dtype=torch.uint8)], options).wait()
            except Exception:  # an engine rank that is gone: close() stops waiting for it
                self._expected.clear()

    # -- the end of the update -----------------------------------------------------------------

    def finish(self) -> dict:
        """``{engine_rank: stream}``: what every engine rank received, one bucket per call, or
        :class:`BroadcastError` naming the first call an engine rank could not receive (a
        :class:`BroadcastMismatchError` for a broadcast refused in the sender)."""
        pending = list(self._expected)
        self._stop_ranks(drain=self._refusal is None)
        if self._refusal is not None:
            raise BroadcastMismatchError(f"broadcast refused in the sender: {self._refusal} "
                                         f"(nothing of it, nor of any later broadcast, reached "
                                         f"the engine ranks)")
        if pending:
            first = pending[0]
            calls = sorted({want.call for want in pending})
            raise BroadcastError(
                f"engine rank 0: call {first.call}: the broadcast of {first.count} announced "
                f"tensor(s) failed: {len(pending)} announced broadcast(s) of call(s) {calls} "
                f"were never sent, first broadcast {first.index + 1} ({first.what}, "
                f"{_described(first.dtype, first.shape)}) (the sender's broadcasts must follow "
                f"its announcements: one per announced tensor, in order, of the announced "
                f"dtype and shape)")
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

    def _stop_ranks(self, drain: bool) -> None:
        """Give the engine ranks the broadcasts announced and never sent (when ``drain``), so
        that none waits out its timeout, then end each rank's thread and wait for it: the one
        ending that :meth:`finish` and :meth:`close` share."""
        if drain and self._expected and self._group is not None:
            self._drain(self._unchecked_send)
        for thread in self._ranks:
            thread.calls.put(None)
        for thread in self._ranks:
            thread.join(self.timeout + 5)

    def _unchecked_send(self, *args, **kwargs):
        import torch.distributed as dist

        return dist.ProcessGroupGloo.broadcast(self._group, *args, **kwargs)

    def close(self) -> None:
        """Stop the engine ranks and unregister and drop the group (idempotent); broadcasts
        announced and never sent (an exporter that raised half way) are given to the engine
        ranks first, so that none waits out its timeout."""
        from torch.distributed import distributed_c10d as c10d

        self._stop_ranks(drain=True)
        if self._group is not None:
            self._group.engine = None
            c10d._world.pg_group_ranks.pop(self._group, None)
        for thread in self._ranks:
            thread.group = None
        self._group = None
        self._ranks = []
        self._expected.clear()


def send(engine, stream, *, flattened: bool = False) -> None:
    """Send ``stream`` to every engine rank of ``engine`` as SGLang's distributed path takes
    it: per bucket, names/dtypes/shapes announced, then each tensor broadcast from this rank
    (with ``flattened``: the bucket ordered by item size, largest first, so that densely
    packed offsets stay aligned, and broadcast as one uint8 buffer)."""
    import torch
    import torch.distributed as dist

    for bucket in stream:
        if flattened:
            bucket = sorted(bucket, key=lambda pair: -pair[1].element_size())
        engine.update_weights_from_distributed(
            [n for n, _ in bucket], [t.dtype for _, t in bucket],
            [tuple(t.shape) for _, t in bucket],
            load_format="flattened_bucket" if flattened else None)
        if flattened:
            flat = torch.cat([tensor_bytes(t) for _, t in bucket]) if bucket else \
                torch.empty(0, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=engine.group)
            continue
        for _, tensor in bucket:
            dist.broadcast(tensor.contiguous(), src=0, group=engine.group)


class Broadcast(Transport):
    """The transport: a channel the harness opens (:meth:`open_channel`, handed to the
    exporter as ``engine``); the exporter returns nothing, the engine ranks' receipts are the
    streams (:meth:`received`)."""

    name = "broadcast"
    docs = "docs/transports.md#broadcast"
    errors = (BroadcastError, WireFormatError)
    channel = True

    def open_channel(self, engine_tp: int) -> BroadcastEngine:
        """The engine ranks a sender broadcasts to (close it when the call is judged)."""
        return BroadcastEngine(engine_tp)

    def received(self, channel: BroadcastEngine) -> dict:
        """``{engine_rank: stream}`` the channel's engine ranks received, or
        :class:`BroadcastError` naming what went wrong."""
        return channel.finish()

    def encode(self, stream, *, engine_rank: int, engine_tp: int, engine=None,
               flattened: bool = False, **options) -> list:
        """Broadcast ``stream`` on ``engine`` (the channel): nothing is returned."""
        if engine is None:
            raise WireFormatError("a broadcast needs the engine channel the harness hands the "
                                  "exporter (its `engine` keyword)")
        send(engine, stream, flattened=flattened)
        return []

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        raise WireFormatError(f"{where}: a broadcast is received on its channel, never "
                              f"returned in a stream")


TRANSPORT = Broadcast()
